"""The colours every drawing and the report share: a colour per stage, the codec's orange, the
tied parameters' gold, the grey of a collective left alone.

Apart from the drawing code so that each part (stages, collectives, the report's cards) takes
its colours from here and none imports another to get them.
"""

from __future__ import annotations

STAGE_COLOURS = ["#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd", "#d0e0e3",
                 "#ead1dc"]
STAGE_BORDERS = ["#3d85c6", "#6aa84f", "#bf9000", "#cc0000", "#674ea7", "#e69138", "#45818e",
                 "#a64d79"]
CODEC_FILL, CODEC_BORDER = "#fbd9b0", "#e69138"
TIED_FILL, TIED_BORDER = "#ffe599", "#bf9000"
#: a collective that no codec compresses
KEPT_FILL, KEPT_BORDER = "#eeeeee", "#999999"


def stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def stage_border(stage: int) -> str:
    return STAGE_BORDERS[stage % len(STAGE_BORDERS)]
