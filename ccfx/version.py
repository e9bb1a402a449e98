"""ccfx's version, apart from the package face so that a layer that only prints it (the HTML
report) need not import ``ccfx`` itself, which imports every layer."""

__version__ = "0.1.0"
