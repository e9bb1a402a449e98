"""What the layout planner knows about a model: per layer, its FLOPs, parameters, the
activations it keeps for backward and the tensor it hands to the next layer.

Plain data, measured once by the compile layer (:func:`ccfx.backends.plan_parallel.model_facts`
traces the model on meta tensors, so a 1 B-parameter model costs no memory) at one batch, the
*traced* batch; every figure but the parameters is linear in the batch and is scaled to a
microbatch here (:meth:`ModelFacts.per_sample`). A layer is one of the model's repeated
blocks (``blocks.3``, ``model.layers.3``): the planner cuts pipeline stages only before a
block, so what comes before the first block (embeddings) is counted in the first block and
what comes after the last (final norm, LM head, loss) in the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class LayerFacts:
    """One block at the traced batch: ``flops`` of its forward (multiply-adds count two),
    ``saved_bytes`` the activations autograd keeps for its backward (parameters not counted),
    ``out_shape`` / ``out_dtype`` the tensor a cut after it would send, ``max_saved_bytes``
    the largest one tensor among the saved (a transformer's MLP hidden: the backward's first
    gradients are that size; 0: unknown, the planner takes the output's size).

    Two shares of ``saved_bytes`` price tensor parallelism and selective recomputation:
    ``tp_saved_bytes`` what a Megatron TP split shards without sequence parallelism (from a
    column-parallel linear's output to the row-parallel linear's input: q / k / v, the
    attention, the MLP's hidden; the norms' inputs and the residual stay whole); None: all of
    it (a layer without a TP plan); ``attn_core_saved_bytes`` / ``attn_core_flops`` the
    attention core's saved bytes and forward FLOPs (scores, softmax, dropout and their
    matmuls, or an SDPA kernel): what Megatron's selective recomputation drops and runs
    again."""

    name: str
    flops: float
    param_numel: int
    param_bytes: int
    saved_bytes: int
    out_shape: tuple[int, ...]
    out_dtype: str = "float32"
    param_shapes: tuple[tuple[int, ...], ...] = ()
    ops: int = 0  # aten ops of its forward (views left out), whatever the batch
    max_saved_bytes: int = 0
    tp_saved_bytes: int | None = None
    attn_core_saved_bytes: int = 0
    attn_core_flops: float = 0.0

    def __post_init__(self):
        _fill_shares(self, f"layer {self.name!r}")

    @property
    def out_bytes(self) -> int:
        n = 1
        for d in self.out_shape:
            n *= int(d)
        return n * _itemsize(self.out_dtype)


@dataclass(frozen=True)
class ModelFacts:
    """The blocks in order, the traced ``batch`` (samples), whether the model declares a
    tensor-parallel plan (``tp_plan``: module pattern → style, as Hugging Face's
    ``base_model_tp_plan``), how the facts were obtained (``source``) and its main matmul
    shape (``matmul``)."""

    layers: tuple[LayerFacts, ...]
    batch: int
    tp_plan: tuple[tuple[str, str], ...] | None = None
    source: str = "fake-tensor trace"
    #: (rows, inner, columns) at the traced batch of the matmul shape doing the most FLOPs:
    #: where a device measured here is timed (a CPU's rate differs 3x between shapes)
    matmul: tuple[int, int, int] | None = None
    #: the model itself timed on this machine (:class:`MeasuredCompute`), or None
    measured: MeasuredCompute | None = None
    #: a Megatron plan derived from the first block's data flow where none is declared
    #: (:mod:`ccfx.backends.tp_derive`): searched with ``tensor_parallel=True``
    derived_tp_plan: tuple[tuple[str, str], ...] | None = None

    def __post_init__(self):
        if not self.layers:
            raise ConfigError("model facts: no layers: the model has nothing to plan")
        if self.batch < 1:
            raise ConfigError(f"model facts: the traced batch is {self.batch}: it must be ≥ 1")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def param_numel(self) -> int:
        return sum(x.param_numel for x in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(x.param_bytes for x in self.layers)

    @property
    def flops(self) -> float:
        return sum(x.flops for x in self.layers)

    def stage(self, lo: int, hi: int) -> StageFacts:
        """Layers ``lo`` … ``hi - 1`` summed, at the traced batch."""
        if not 0 <= lo < hi <= self.num_layers:
            raise ConfigError(f"model facts: stage layers {lo}..{hi - 1} are not within the "
                              f"model's {self.num_layers} layers")
        part = self.layers[lo:hi]
        return StageFacts(
            lo, hi, sum(x.flops for x in part), sum(x.param_numel for x in part),
            sum(x.param_bytes for x in part), sum(x.saved_bytes for x in part),
            max(x.out_bytes for x in part), tuple(s for x in part for s in x.param_shapes),
            sum(x.ops for x in part),
            max(x.max_saved_bytes or x.out_bytes for x in part),
            self.layers[lo - 1].out_bytes if lo > 0 else 0,
            part[-1].out_bytes if hi < self.num_layers else 0,
            tp_saved_bytes=sum(x.tp_saved_bytes for x in part),
            attn_core_saved_bytes=sum(x.attn_core_saved_bytes for x in part),
            attn_core_flops=sum(x.attn_core_flops for x in part))

    def cut_shape(self, layer: int, samples: int) -> tuple[int, ...]:
        """The shape a cut after ``layer`` sends for ``samples`` samples (the batch dimension,
        the first, scaled from the traced batch)."""
        shape = self.layers[layer].out_shape
        if shape and shape[0] == self.batch:
            return (samples, *shape[1:])
        return shape


@dataclass(frozen=True)
class MeasuredCompute:
    """The model's forward and backward timed on this machine at two batch sizes and fitted
    as ``seconds = per_flop · FLOPs + per_op · ops`` (the slope: a transformer's real rate,
    attention, norms and eager lowering included, 1.7x below a 512³ matmul's on this VM; the
    intercept: the per-op overhead a small microbatch pays), and an AdamW step's seconds per
    parameter (the optimizer runs after every step). ``flops_here``: this machine's 512³
    matmul rate at the same thread count, so a device described by its FLOP/s runs the
    measured seconds scaled by ``flops_here / flops`` (a rank given half a core: twice as
    long). Measured by :func:`ccfx.planner.compute.measure_model`. With ``cores`` the ranks
    share that many cores: :func:`ccfx.planner.compute.contention` stretches their compute."""

    fwd_per_flop: float
    fwd_per_op: float
    bwd_per_flop: float
    bwd_per_op: float
    opt_per_param: float
    flops_here: float
    threads: int = 1
    #: the cores this machine's ranks share, where the cluster's devices are processes on it
    #: (a test harness: 4 one-thread ranks on 2 cores); None: a core (or more) each
    cores: int | None = None

    def scale(self, flops: float | None) -> float:
        """How much longer a device of ``flops`` FLOP/s takes than this machine (None: 1)."""
        return 1.0 if flops is None else self.flops_here / flops


@dataclass(frozen=True)
class StageFacts:
    """A run of layers ``lo`` … ``hi - 1``: sums at the traced batch; ``max_out_bytes`` the
    largest tensor one of its layers hands on, ``max_saved_bytes`` the largest one saved for
    the backward (the size of the backward's first temporaries), ``in_bytes`` / ``out_bytes``
    the tensor it receives from the stage before / sends to the one after (0 for the first /
    last stage of the model); the shares of ``saved_bytes`` and the attention core's FLOPs
    summed over its layers (:class:`LayerFacts`; ``tp_saved_bytes`` None: all of it)."""

    lo: int
    hi: int
    flops: float
    param_numel: int
    param_bytes: int
    saved_bytes: int
    max_out_bytes: int
    param_shapes: tuple[tuple[int, ...], ...] = ()
    ops: int = 0
    max_saved_bytes: int = 0
    in_bytes: int = 0
    out_bytes: int = 0
    tp_saved_bytes: int | None = None
    attn_core_saved_bytes: int = 0
    attn_core_flops: float = 0.0

    def __post_init__(self):
        _fill_shares(self, f"stage of layers {self.lo}..{self.hi - 1}")

    @property
    def grad_dtype(self) -> str:
        """The gradients' dtype (torch keeps them in the parameters'): 2-byte parameters are
        taken as bfloat16, others as float32."""
        return "bfloat16" if self.param_numel and self.param_bytes == 2 * self.param_numel \
            else "float32"


_ITEMSIZE = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8,
             "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1,
             "float8_e4m3fn": 1, "float8_e5m2": 1}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(str(dtype).replace("torch.", ""), 4)


def _fill_shares(facts, what: str) -> None:
    """``facts.tp_saved_bytes`` None → all of ``saved_bytes``; a ConfigError where a share of
    the saved bytes is negative or above the whole (``what`` names the layer or stage)."""
    if facts.tp_saved_bytes is None:
        object.__setattr__(facts, "tp_saved_bytes", facts.saved_bytes)
    saved = facts.saved_bytes
    for name in ("tp_saved_bytes", "attn_core_saved_bytes"):
        share = getattr(facts, name)
        if not 0 <= share <= saved:
            raise ConfigError(f"model facts: {what} has {name}={share} outside 0 … its "
                              f"saved_bytes={saved}: a share of the saved bytes is part of "
                              "them; give it between 0 and saved_bytes")
