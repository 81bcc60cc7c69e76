"""Causal attention through fused kernels (PyTorch's flash, cuDNN, FlashAttention-4, memory-efficient), keeping
output and log-sum-exp for memo's explicit backward; one API whatever kernel runs.

q, k, v are (batch, heads, seq, head_dim) views; k and v may have fewer heads (grouped-query attention).
`attention_forward` returns (out, lse, aux): lse is float32 (b, heads, s') and `aux` starts with the name of the
kernel that ran, then what that kernel's backward needs besides (q, k, v, out, lse); it is small and stays on
device (without dropout it is the same for every call over the same lengths). `attention_backward` runs the
backward of the kernel `aux` names, so a forward that fell back is always paired with its own backward.

Kernels (`--attention`, default "auto"):
- "flash": PyTorch's flash kernel, FlashAttention-2 on CUDA (16-bit), `_scaled_dot_product_flash_attention_for_cpu`
  on a CPU; grouped-query k, v as they are.
- "cudnn": cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention`, in every CUDA build of torch);
  grouped-query heads natively (pytorch#150337); its LSE is (b, h, s, 1).
- "fa4": FlashAttention-4 (`flash-attn-4`, an optional extra) on sm90 / sm100, called as PyTorch's own FA4
  backend calls it (torch/nn/attention/_fa4.py: `_flash_attn_fwd` / `_flash_attn_bwd` on (b, s, h, d) views,
  which memo's token-major buffers already are), wrapped as the custom op `memo::fa4_attention` so a meta trace
  and the phase planner see one op.
- "efficient": the memory-efficient kernel, the one that takes fp32 on CUDA; k, v repeated to the query heads;
  its LSE is padded to a multiple of 32 tokens.

"auto" takes the first that can run of fa4, cudnn, flash on Hopper and Blackwell (the FA3 paper measures cuDNN
ahead of FlashAttention-2 there, arXiv 2407.08608 Fig. 5-6), flash before cudnn elsewhere, and efficient for
fp32. A kernel that refuses a shape at run time falls back to the next one, and says so once per shape.

Packed documents (`memo.documents`): with `documents` a token attends only within its own document. PyTorch's
CUDA flash kernel runs them all in one variable-length call (`aten._flash_attention_forward` with cumulative
lengths over the b·s tokens, as torch.nn.attention.varlen calls it; its LSE is (h, b·s)); every other kernel, and
the CPU's, runs once per run of equal-length neighbouring documents (a batch of them) on their rows, which is
exact and costs Σ dᵢ² like the variable-length kernel. The backward follows the forward's path (aux says
which); attention is still never recomputed.

Heads are independent, so a layer may call the kernels on a few heads at a time (`head_chunks`): each call's
outputs and scratch (the backward's fp32 dq accumulator, its expanded dk and dv under grouped-query attention)
then take about as much memory as one tile of the token-local work, not all heads' worth.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass

import torch

from .device import has_fused_kernel, kernel_device_type
from .documents import Documents
from .window import band_backward, band_forward

aten = torch.ops.aten
log = logging.getLogger(__name__)
KERNELS = ("flash", "cudnn", "fa4", "efficient")  # what `--attention` names (besides "auto")
CHOICES = ("auto", *KERNELS)
HALF = (torch.float16, torch.bfloat16)
FA4_MODULE = "flash_attn.cute.interface"  # where flash-attn-4 keeps its kernels' entry points
_refused: dict[tuple, str] = {}  # (kernel, shape key) -> why it refused: tried once per process
# how kernels refuse a shape: aten's checks (RuntimeError), flash-attn-4's asserts and ValueErrors, a missing
# package; never a fault of the device (an illegal access poisons the context for every kernel after it) or memory
REFUSALS = (RuntimeError, NotImplementedError, ImportError, AssertionError, ValueError)
FATAL = (torch.OutOfMemoryError, *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()))


def check_choice(name: str) -> str:
    """Returns `name` if it names a kernel choice; ValueError naming `--attention` if not."""
    if name not in CHOICES:
        raise ValueError(f"`--attention` must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


# ---- availability and choice -------------------------------------------------------------------------------
@functools.cache
def _fa4_installed() -> bool:
    """Returns whether flash-attn-4 can be found (looked up once per process); a broken `flash_attn` package (e.g.
    a FlashAttention-2 build for another torch, which fails on import) counts as absent, not as an error of every
    attention call."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:
        return False


def _capability(device: torch.device) -> tuple[int, int] | None:
    """Returns the compute capability of a real CUDA device, None elsewhere (meta, CPU)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def available(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """Returns the kernels that can run causal attention on `dtype` tensors on `device` (on meta: for the kernels
    `device.meta_kernels` names)."""
    kind = kernel_device_type(device)
    half = dtype in HALF or kind != "cuda"  # the 16-bit-only rule is CUDA's kernels'; a registered one decides
    found = []
    if kind == "cpu" or (half and has_fused_kernel("aten::_scaled_dot_product_flash_attention", kind)):
        found.append("flash")
    if half and has_fused_kernel("aten::_scaled_dot_product_cudnn_attention", kind) and _cudnn_built(device):
        found.append("cudnn")
    capability = _capability(device)
    fa4_arch = capability is None or capability[0] in (9, 10)
    # the package matters on a real GPU only: on meta the op's fake kernel stands for it (a cost model prices FA4
    # without it installed)
    fa4_here = has_fused_kernel("memo::fa4_attention", kind) and (device.type != "cuda" or _fa4_installed())
    if half and fa4_arch and fa4_here:
        found.append("fa4")
    if has_fused_kernel("aten::_scaled_dot_product_efficient_attention", kind):
        found.append("efficient")
    return tuple(found)


def _cudnn_built(device: torch.device) -> bool:
    """Returns False on a real CUDA device whose torch lacks cuDNN (a meta trace assumes the usual build)."""
    return device.type != "cuda" or torch.backends.cudnn.is_available()


def _preference(device: torch.device) -> tuple[str, ...]:
    """Returns the kernels "auto" tries in order on `device`: the Hopper-class ones first on sm90 and later."""
    capability = _capability(device)
    if capability is not None and capability >= (9, 0):
        return ("fa4", "cudnn", "flash", "efficient")
    return ("flash", "cudnn", "fa4", "efficient")


def choose(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Returns the kernel that runs for `requested` ("auto" or a kernel) on `device` and `dtype`; a ValueError
    naming `--attention` when the requested kernel cannot run there at all."""
    here = available(device, dtype)
    if requested == "auto":
        return next(k for k in _preference(device) if k in here)
    if requested not in here:
        where = f"{kernel_device_type(device)} {str(dtype).removeprefix('torch.')}"
        raise ValueError(f"`--attention {requested}` cannot run on {where} here; kernels that can: {', '.join(here)}")
    return requested


def lse_seq_len(seq_len: int, kernel: str) -> int:
    """Returns the length of the LSE's token dimension `kernel` writes: the efficient kernel pads it to 32."""
    return -(-seq_len // 32) * 32 if kernel == "efficient" else seq_len


MIN_CALL_ROWS = 1 << 16  # query rows x heads per call that keep a GPU's SMs busy (512 blocks of 128 rows)


def heads_per_call(heads: int, seq: int, tile: int, device: torch.device) -> int:
    """Returns how many of `heads` query heads attending over `seq` tokens each kernel call takes by default: on a
    GPU about `tile` rows of every head (heads·tile/seq heads, at least one), never fewer rows than fill it; the
    CPU kernels spread their work over heads (one head runs on one thread): all of them."""
    if kernel_device_type(device) != "cuda":
        return heads
    return min(heads, max(1, heads * tile // seq, -(-MIN_CALL_ROWS // seq)))


def head_chunks(heads: int, kv_heads: int, per_call: int) -> list[tuple[slice, list[slice]]]:
    """Returns the kernel calls over `heads` query heads, at most `per_call` each, as (key/value heads, the
    query-head slices that use them): whole key/value groups per call, or parts of one group."""
    group = heads // kv_heads
    if per_call >= group:
        kv = _divisor_at_most(kv_heads, per_call // group)
        return [(slice(j, j + kv), [slice(j * group, (j + kv) * group)]) for j in range(0, kv_heads, kv)]
    size = _divisor_at_most(group, per_call)
    return [
        (slice(j, j + 1), [slice(j * group + i, j * group + i + size) for i in range(0, group, size)])
        for j in range(kv_heads)
    ]


def _divisor_at_most(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def _repeat_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Returns k or v with heads repeated to `n_heads` (the efficient kernel wants equal head counts)."""
    rep = n_heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _sum_kv(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Returns the gradient of repeated k/v folded back onto its `n_kv` heads."""
    b, heads, s, d = grad.shape
    return grad if heads == n_kv else grad.view(b, n_kv, heads // n_kv, s, d).sum(2)


# ---- the kernels: forward (q, k, v, scale) -> (out, lse, aux); backward -> (dq, dk, dv) on k's heads ------------
def _flash_forward(q, k, v, scale, window: int | None = None):
    b, _, s, _ = q.shape
    windowed = window is not None and window < s
    if not has_fused_kernel("aten::_scaled_dot_product_flash_attention", kernel_device_type(q.device)):
        if windowed:
            return (*band_forward(q, k, v, scale, window), ("band", window))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    if windowed:  # the variable-length entry point is the one that takes a window: b sequences of s tokens
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        out, lse, aux = _varlen_forward(q, k, v, scale, cu, s, window)
        return out, lse, ("window", *aux)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(dout, q, k, v, out, lse, aux, scale):
    if not aux:  # the CPU kernel
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )
    if aux[0] == "band":
        return band_backward(dout, q, k, v, out, lse, scale, aux[1])
    if aux[0] == "window":
        return _varlen_backward(dout, q, k, v, out, lse, aux[1:], scale)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )[:3]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Returns `t` (b, h, s, d) over dense (b, s, h, d) memory, copied only when it is not already: cuDNN builds
    its graph from q's layout and checks out, dout and the gradients against it (aten/src/ATen/native/cudnn/
    MHA.cpp, `check_tensor_matches_graph`), which a few heads of a token-major buffer, or one document of a batch
    (a size-one batch dimension keeps its parent's stride), do not match."""
    bshd = t.transpose(1, 2)
    b, s, h, d = bshd.shape
    if bshd.stride() != (s * h * d, h * d, d, 1):
        bshd = bshd.new_empty(bshd.shape).copy_(bshd)
    return bshd.transpose(1, 2)


def _cudnn_forward(q, k, v, scale):
    q, k, v = _dense(q), _dense(k), _dense(v)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale
    )
    return out, lse.squeeze(-1), (cum_q, cum_k, max_q, max_k, seed, offset)  # lse (b, h, s, 1) -> (b, h, s)


def _cudnn_backward(dout, q, k, v, out, lse, aux, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    dout, q, k, v, out = (_dense(t) for t in (dout, q, k, v, out))
    stats = lse.contiguous().unsqueeze(-1)  # back to the kernel's (b, h, s, 1)
    saved = (out, stats, seed, offset, None, cum_q, cum_k, max_q, max_k)
    return aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, *saved, 0.0, True, scale=scale)


def _efficient_forward(q, k, v, scale):
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=scale)
    return out, lse, (seed, offset)


def _efficient_backward(dout, q, k, v, out, lse, aux, scale):
    n_kv = k.shape[1]
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    seed, offset = aux
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale
    )
    return dq, _sum_kv(dk, n_kv), _sum_kv(dv, n_kv)


def _fa4_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out (b, h, s, d), lse (b, h, s) fp32) of causal FlashAttention-4 on (b, h, s, d) views."""
    fa4 = importlib.import_module(FA4_MODULE)
    out = torch.empty_like(q)  # the query's layout, written through a (b, s, h, d) view as FA4 wants
    bshd = (t.transpose(1, 2) for t in (q, k, v))
    found = fa4._flash_attn_fwd(*bshd, softmax_scale=scale, causal=True, return_lse=True, out=out.transpose(1, 2))
    return out, found[1].contiguous()  # (out, lse, ...): flash-attn-4 4.0.0b36 returns three more, older ones none


def _fa4_run_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv), (b, heads, s, d) each on its own head count, of `_fa4_run`."""
    fa4 = importlib.import_module(FA4_MODULE)
    q_, k_, v_, out_, dout_ = (t.transpose(1, 2) for t in (q, k, v, out, dout))
    dq, dk, dv = fa4._flash_attn_bwd(q_, k_, v_, out_, dout_, lse.contiguous(), softmax_scale=scale, causal=True)[:3]
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# one op each on every device (a test registers `_fa4_run` for the CPU with a stand-in module), with a fake
# kernel so a meta trace and the phase planner's replay see FA4 as one op
fa4_attention = torch.library.custom_op("memo::fa4_attention", _fa4_run, mutates_args=(), device_types="cuda")
fa4_attention_backward = torch.library.custom_op(
    "memo::fa4_attention_backward", _fa4_run_backward, mutates_args=(), device_types="cuda"
)


@fa4_attention.register_fake
def _fa4_attention_fake(q, k, v, scale):
    b, h, s, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


@fa4_attention_backward.register_fake
def _fa4_attention_backward_fake(dout, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_forward(q, k, v, scale):
    out, lse = fa4_attention(q, k, v, scale)
    return out, lse, ()


def _fa4_backward(dout, q, k, v, out, lse, aux, scale):
    return fa4_attention_backward(dout, q, k, v, out, lse, scale)


_FORWARD = {"flash": _flash_forward, "cudnn": _cudnn_forward, "fa4": _fa4_forward, "efficient": _efficient_forward}
_BACKWARD = {"flash": _flash_backward, "cudnn": _cudnn_backward, "fa4": _fa4_backward, "efficient": _efficient_backward}


# ---- the API -----------------------------------------------------------------------------------------------
def _shape_key(kernel: str, q: torch.Tensor, k: torch.Tensor, documents: Documents | None) -> tuple:
    """Returns what a refusal is remembered by: a kernel may refuse one document and take whole sequences."""
    key = kernel, q.device.type, q.dtype, q.shape[1], k.shape[1], q.shape[-1], q.shape[-2]
    return key if documents is None else (*key, "packed")


def _fallbacks(kernel: str, q: torch.Tensor):
    """Yields `kernel`, then (only once it refused) the kernels to try next, in "auto"'s order: those whose LSE has
    the same length, which the layer sized for the first."""
    yield kernel
    here, s = available(q.device, q.dtype), q.shape[-2]
    same = (k for k in _preference(q.device) if k in here and lse_seq_len(s, k) == lse_seq_len(s, kernel))
    yield from (k for k in same if k != kernel)


def attention_forward(
    q, k, v, scale: float, kernel: str = "auto", documents: Documents | None = None, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Returns (out, lse, aux) of causal attention: out (b, heads, s, d), lse float32 (b, heads, s'), aux
    (the kernel that ran, *what its backward needs). `kernel` ("auto" or a name) is tried first; one that
    refuses the shape hands over to the next and is not tried at that shape again. With `documents` each token
    attends only within its own document (`_documents_forward`); with a `window` shorter than a sequence (or
    document) it sees itself and the `window - 1` tokens before it, through the flash kernel whatever `kernel`
    says (the only one that takes a window: on CUDA itself, on a CPU in bands, `memo.window`)."""
    first = choose(kernel, q.device, q.dtype)
    if documents is not None and kernel == "auto" and _varlen("flash", q) and "flash" in available(q.device, q.dtype):
        first = "flash"  # one variable-length call rather than one call per document
    length = q.shape[-2] if documents is None else documents.max_length
    if window is not None and window >= length:
        window = None  # the window covers every sequence: plain causal attention, on any kernel
    if window is not None:
        if "flash" not in available(q.device, q.dtype):
            where = f"{kernel_device_type(q.device)} {str(q.dtype).removeprefix('torch.')}"
            raise RuntimeError(f"sliding-window attention runs on the flash kernel, which cannot run {where}")
        first = "flash"
    for name in _fallbacks(first, q) if window is None else ("flash",):
        key = _shape_key(name, q, k, documents)
        if key in _refused:
            continue
        try:
            if window is not None and documents is None:
                out, lse, aux = _flash_forward(q, k, v, scale, window)
            elif documents is None:
                out, lse, aux = _FORWARD[name](q, k, v, scale)
            else:
                out, lse, aux = _documents_forward(name, q, k, v, scale, documents, window)
        except FATAL:
            raise
        except REFUSALS as err:
            _refused[key] = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            log.warning("attention: %s refused %s; trying the next kernel", name, _describe(key, _refused[key]))
            continue
        return out, lse, (name, *aux)
    raise RuntimeError(f"no attention kernel could run {tuple(q.shape)} {q.dtype}: {refusals()}")


def attention_backward(dout, q, k, v, out, lse, aux: tuple, scale: float, documents: Documents | None = None):
    """Returns (dq, dk, dv) for `attention_forward`, by the backward of the kernel that ran it (aux[0]), with
    dk, dv on k's and v's own head count; `documents` as the forward had them."""
    if documents is None:
        return _BACKWARD[aux[0]](dout, q, k, v, out, lse, aux[1:], scale)
    return _documents_backward(aux[0], dout, q, k, v, out, lse, aux[1:], scale, documents)


# ---- packed documents: one variable-length call (flash on CUDA) or one call of any kernel per document ----------
def _varlen(name: str, q: torch.Tensor) -> bool:
    """Returns whether `name` runs all documents in one variable-length call here: PyTorch's CUDA flash kernel
    does (`_flash_attention_forward` with cumulative lengths, as torch.nn.attention.varlen calls it)."""
    return name == "flash" and has_fused_kernel("aten::_flash_attention_forward", kernel_device_type(q.device))


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """Returns (b, h, s, d) as the variable-length kernels' (b·s, h, d), a view of a token-major buffer."""
    return t.transpose(1, 2).flatten(0, 1)


def _heads(t: torch.Tensor, b: int) -> torch.Tensor:
    """Returns (b·s, h, d) as (b, h, s, d): the inverse of `_tokens`."""
    return t.unflatten(0, (b, -1)).transpose(1, 2)


def _varlen_forward(q, k, v, scale, cu: torch.Tensor, most: int, window: int | None = None):
    """Returns (out, lse, aux) of CUDA's variable-length flash call over the sequences `cu` delimits in the b·s
    tokens of q (b, heads, s, d), at most `most` long, a `window` passed as the kernel takes it; aux is what
    `_varlen_backward` needs: (cu, most, seed, offset, window)."""
    b, _, s, _ = q.shape
    out, lse, seed, offset, _ = aten._flash_attention_forward(
        _tokens(q), _tokens(k), _tokens(v), cu, cu, most, most, 0.0, True, False, scale=scale, **_window_args(window)
    )
    return _heads(out, b), lse.unflatten(1, (b, s)).transpose(0, 1), (cu, most, seed, offset, window)  # lse (h, b·s)


def _varlen_backward(dout, q, k, v, out, lse, aux: tuple, scale):
    b, (cu, most, seed, offset, window) = q.shape[0], aux
    tokens_lse = lse.transpose(0, 1).flatten(1).contiguous()  # (h, b·s), as the kernel wrote it
    tokens = (_tokens(t) for t in (dout, q, k, v, out))
    grads = aten._flash_attention_backward(
        *tokens, tokens_lse, cu, cu, most, most, 0.0, True, seed, offset, scale=scale, **_window_args(window)
    )
    return tuple(_heads(g, b) for g in grads)


def _window_args(window: int | None) -> dict:
    """Returns the flash kernel's window arguments: a token sees itself and the `window - 1` before it."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def _documents_forward(name, q, k, v, scale, documents: Documents, window: int | None = None):
    b, heads, s, _ = q.shape
    if _varlen(name, q):
        cu, most = documents.cu_seqlens, documents.max_length
        out, lse, aux = _varlen_forward(q, k, v, scale, cu, most, window)
        return out, lse, ("varlen", *aux)
    out = q.new_empty(q.shape)
    lse = q.new_empty((b, heads, lse_seq_len(s, name)), dtype=torch.float32)
    auxes = []
    forward = _FORWARD[name] if window is None else functools.partial(_flash_forward, window=window)
    for run in _runs(documents, s):  # equal-length neighbours of one sequence: one call, as a batch of them
        part_out, part_lse, part_aux = forward(*(run.of(t) for t in (q, k, v)), scale)
        run.of(out).copy_(part_out)
        run.of(lse).copy_(part_lse[..., : run.length])
        auxes.append(part_aux)
    return out, lse, ("per document", tuple(auxes))


def _documents_backward(name, dout, q, k, v, out, lse, aux, scale, documents: Documents):
    b, _, s, _ = q.shape
    if aux[0] == "varlen":
        return _varlen_backward(dout, q, k, v, out, lse, aux[1:], scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for run, part_aux in zip(_runs(documents, s), aux[1]):
        parts = (run.of(t) for t in (dout, q, k, v, out))
        gq, gk, gv = _BACKWARD[name](*parts, _padded_lse(run.of(lse[..., :s]), name), part_aux, scale)
        for whole, part in zip((dq, dk, dv), (gq, gk, gv)):
            run.of(whole).copy_(part)
    return dq, dk, dv


@dataclass(frozen=True)
class _Run:
    """`count` documents of `length` tokens each, one after another from token `start` of sequence `row`."""

    row: int
    start: int
    length: int
    count: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """Returns the run's tokens of `t` (b, h, s[, d]) as a batch of its documents, (count, h, length[, d]): a
        view, which writes back into `t`."""
        rows = t[self.row, :, self.start : self.start + self.count * self.length]  # (h, count·length[, d])
        return rows.unflatten(1, (self.count, self.length)).transpose(0, 1)


def _runs(documents: Documents, s: int) -> list[_Run]:
    """Returns the documents of a batch of `s`-token sequences as runs of equal-length neighbours in one
    sequence (a kernel call each: sixteen one-token documents are one call, not sixteen)."""
    runs: list[_Run] = []
    for start, stop in documents.bounds:
        row, at, length = start // s, start % s, stop - start
        last = runs[-1] if runs else None
        if last and last.row == row and last.length == length and last.start + last.count * length == at:
            runs[-1] = _Run(row, last.start, length, last.count + 1)
        else:
            runs.append(_Run(row, at, length, 1))
    return runs


def _padded_lse(lse: torch.Tensor, name: str) -> torch.Tensor:
    """Returns a run's LSE (count, h, d) as long as `name`'s kernel writes it (the efficient one pads to 32)."""
    d = lse.shape[-1]
    if lse_seq_len(d, name) == d:
        return lse
    return torch.cat((lse, lse.new_zeros((*lse.shape[:-1], lse_seq_len(d, name) - d))), dim=-1)


def _describe(key: tuple, why: str) -> str:
    _, device, dtype, heads, kv_heads, d, s = key[:7]
    packed = " of packed documents" if len(key) > 7 else ""
    where = f"{str(dtype).removeprefix('torch.')} on {device}"
    return f"{heads}/{kv_heads} heads of dim {d} x {s} tokens{packed}, {where} ({why})"


def refusals() -> list[str]:
    """Returns each kernel that refused a shape in this process, with the shape and why (a run reports them
    beside the kernel it used)."""
    return [f"{key[0]}: {_describe(key, why)}" for key, why in _refused.items()]
