"""One plan for every sequence length: a plan whose graph torch.export traced at a fixed length
serves every shorter length by padding the step's inputs on the right to the traced length and
cutting the outputs back, exactly ([Note: padding to the traced length]).

Terms
- **traced length** ``L``: dim 1 of the token ids (the first integer tensor input with two or more
  dims) in a plan traced by torch.export with the sequence static ([Note: a static sequence for
  export] in fxsplit.graph.trace), also where the graph was then made to follow the length ([Note:
  following the sequence from two static traces] in fxsplit.graph.sequence: every length 2..L runs
  as it is there, and only a step of one position, or every shorter step once verify found the
  following inexact, is padded); None for fx traces and ``dynamic_sequence=True`` (the sequence is
  a symbol there, every length runs as it is) and with ``pad_sequence=False``.
- **step length** ``t``: dim 1 of the token ids a call is given, ``1 <= t <= L``.
- **sequence input**: a tensor input whose traced dim 1 is ``L`` (token ids, attention mask,
  position ids, labels, embeddings); **sequence output**: a model output with two or more dims
  whose dim 1 is ``L``.

[Note: padding to the traced length]
Tracing the sequence as a symbol costs torch.export several times the static trace (the 70B plan
would miss its time goal), so a static plan serves a shorter step by padding: every sequence input
is extended on the right from t to L positions with a value that the model reads as nothing
(``attention_mask``: 0, the padded keys masked; ``labels``: -100, the index Hugging Face's losses
ignore; ``position_ids``: counting on from the last position, so that a packed row's last document
simply continues into the padding; anything else: 0), the stages run at L as planned (their
boundary shapes are the plan's: no per-step handshake, every schedule as it is), and on the last
stage every sequence output is cut back to its first t positions before ``loss_fn`` sees it (and
before ``pm(x)`` returns it). The backward then starts from zero gradients at the padded positions.

This is exact when no real position reads a padded one: a causal model (each position sees only
earlier ones), or a bidirectional one given an ``attention_mask`` (the padded keys are masked out).
The padded positions' own outputs are garbage and are thrown away. A model where a real position
sees a later one without a mask (an encoder called without ``attention_mask``, a mean over the
sequence) would be changed by the padding: :func:`check_padding`, run by ``fxsplit.verify`` (which
``parallelize`` runs by default on small models), compares the plan padded from a shorter length
with the model run at that length; when they differ, a shorter step on that plan raises naming
``pad_sequence=False`` (only the traced length runs, as before) or ``dynamic_sequence=True`` (a
symbolic sequence), and verify itself raises so when the user asked for padding
(``pad_sequence=True``) or gave an example shorter than the traced length. The padded
work is real work: a step at t costs what a step at L costs.

    x, t = pad_to_traced(flat, plan)         # padded flat inputs, the step length (None: no padding)
    trim = outputs_cut(plan, t)              # flat outputs -> the first t positions (None: no cut)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fxsplit.errors import PlanError, VerificationError

if TYPE_CHECKING:
    from fxsplit.api import Plan

__all__ = ["check_padding", "follows", "outputs_cut", "pad_to_traced", "sequence_summary", "traced_length"]

# what a padded position holds, by input name ([Note: padding to the traced length]); every other
# sequence input is padded with zeros
_PAD_VALUE = {"attention_mask": 0, "labels": -100}
_COUNTING = ("position_ids",)


def _static(d: Any) -> int | None:
    try:
        return int(d)
    except TypeError:
        return None


def traced_length(plan_: Plan) -> int | None:
    """``L`` of the Terms, or None when the plan takes every length as it is or must not pad."""
    info = plan_.graph.meta.get("fxsplit")
    if plan_.config.pad_sequence is False or info is None or info.method != "export":
        return None
    if info.follows_sequence:
        return info.traced_length
    if "seq" in info.symbols:
        return None
    for meta in plan_.stages.input_meta:
        if meta.is_tensor and meta.dtype is not None and not meta.dtype.is_floating_point and len(meta.shape) >= 2:
            return _static(meta.shape[1])
    return None


def follows(plan_: Plan) -> bool:
    """Whether the plan runs a step of 2 <= t <= L positions at t ([Note: following the sequence from two
    static traces] in fxsplit.graph.sequence) rather than padded to L: the trace follows the length and
    ``fxsplit.verify`` did not find it inexact."""
    info = plan_.graph.meta.get("fxsplit")
    return (info is not None and info.follows_sequence and traced_length(plan_) is not None
            and getattr(plan_, "_following_refused", None) is None)


def sequence_summary(plan_: Plan) -> str | None:
    """The plan's line on sequence lengths: which run as they are and which are padded, and why."""
    length = traced_length(plan_)
    if length is None:
        return None
    if follows(plan_):
        return (f"sequence: every length 2..{length} runs as it is, the stage boundaries follow it (1 is padded "
                f"to {length}): [Note: following the sequence from two static traces]")
    info, c = plan_.graph.meta["fxsplit"], plan_.config
    why = (getattr(plan_, "_following_refused", None) or ("cp > 1 cuts a static length" if c.cp > 1 else None)
           or (None if c.follow_sequence else "follow_sequence=True would run them at their own length")
           or info.follow_refused
           or "the model is on the meta device (follow_sequence=True traces it a second time)")
    refused = getattr(plan_, "_padding_refused", None)
    if refused:
        return f"sequence: only {length} runs ({refused})"
    return f"sequence: traced at {length}, shorter steps padded to it ({why})"


def _is_sequence_dim(d: Any, length: int, following: bool) -> bool:
    return _static(d) is None if following else _static(d) == length


def _pad(x: torch.Tensor, name: str, t: int, length: int) -> torch.Tensor:
    extra = list(x.shape)
    extra[1] = length - t
    if name in _COUNTING and not x.is_floating_point():
        steps = torch.arange(1, length - t + 1, dtype=x.dtype, device=x.device)
        tail = x[:, -1:] + steps.view(1, -1, *([1] * (x.dim() - 2)))
    else:
        tail = torch.full(extra, _PAD_VALUE.get(name, 0), dtype=x.dtype, device=x.device)
    return torch.cat([x, tail.expand(extra)], dim=1)


def pad_to_traced(flat: Sequence[Any], plan_: Plan) -> tuple[list[Any], int | None]:
    """The flat inputs with every sequence input padded from the step length t to L, and t; the
    inputs as given and None when nothing is padded (no traced length, t = L, or a plan that follows
    the length and 2 <= t). Raises PlanError naming the fix when t > L, or when the sequence inputs
    disagree on t."""
    length = traced_length(plan_)
    metas = plan_.stages.input_meta
    if length is None or len(flat) != len(metas):
        return list(flat), None
    info = plan_.graph.meta["fxsplit"]
    seq = [i for i, (m, x) in enumerate(zip(metas, flat)) if isinstance(x, torch.Tensor) and m.is_tensor
           and len(m.shape) >= 2 and _is_sequence_dim(m.shape[1], length, info.follows_sequence)
           and x.dim() == len(m.shape)]
    if not seq:
        return list(flat), None
    lengths = {metas[i].name: flat[i].shape[1] for i in seq}
    if len(set(lengths.values())) > 1:
        raise PlanError(f"the sequence inputs have different lengths (dim 1): {lengths}; give every sequence "
                        "input the same length")
    t = next(iter(lengths.values()))
    if t > length or t < 1:
        raise PlanError(
            f"a sequence of {t} positions (dim 1 of {sorted(lengths)}) does not fit the plan, which torch.export "
            f"traced at {length}: a plan serves every length up to the traced one ([Note: padding to the traced "
            f"length] in fxsplit.api.padding). Plan with an example of the longest length you will run, or with "
            "dynamic_sequence=True (a symbolic sequence, a slower trace)")
    if t == length or (t >= 2 and follows(plan_)):
        return list(flat), None
    if t < length and (why := getattr(plan_, "_padding_refused", None)):
        raise PlanError(f"a sequence of {t} positions: {why}")
    out = list(flat)
    for i in seq:
        out[i] = _pad(flat[i], metas[i].name, t, length)
    return out, t


def outputs_cut(plan_: Plan, t: int | None) -> Callable[[list[Any]], list[Any]] | None:
    """A function of the flat model outputs that cuts every sequence output back to its first t
    positions; None when ``t`` is None (nothing was padded)."""
    length = traced_length(plan_)
    if t is None or length is None:
        return None

    def cut(flat_out: list[Any]) -> list[Any]:
        return [x[:, :t] if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == length else x
                for x in flat_out]

    return cut


def _shorter(args: tuple, kwargs: dict, length: int, t: int) -> tuple[tuple, dict]:
    def cut(x: Any) -> Any:
        return x[:, :t] if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == length else x

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _differences(outs: Sequence[Any], ref: Sequence[Any], close: Callable[[Any, Any], tuple[bool, float]]) -> list[str]:
    bad = []
    for k, (x, r) in enumerate(zip(outs, ref)):
        if isinstance(r, torch.Tensor) and r.is_floating_point():
            ok, err = close(x, r) if isinstance(x, torch.Tensor) and x.shape == r.shape else (False, float("inf"))
            if not ok:
                bad.append(f"output {k} (relative error {err:.3g})")
    return bad


def check_padding(model: torch.nn.Module, example_args: tuple, example_kwargs: dict, plan_: Plan,
                  run_plan: Callable[[list[Any]], list[Any]], close: Callable[[Any, Any], tuple[bool, float]],
                  strict: bool = True) -> None:
    """[Note: padding to the traced length]: ``run_plan(flat)`` (the plan's flat outputs on tp rank
    0) on the example cut to t = L // 2 positions (an example shorter than L as it is), run as a step
    would (at t on a plan that follows the length, else padded back to L and cut to t), against the
    model run on the cut example; ``close(x, ref)`` is verify's comparison. A plan that follows the
    length and differs there stops following (shorter steps are padded; [Note: following the sequence
    from two static traces] in fxsplit.graph.sequence) and the padding is checked in turn. When the
    padding changes an output: raises VerificationError naming the fix (``strict``: the user asked for
    padding, or the example itself is shorter than L), else refuses padding for this plan (a shorter
    step then raises PlanError with the same words) and returns: the plan is right at its traced length."""
    from torch.utils import _pytree as pytree

    from fxsplit.graph.trace import flatten_inputs

    length = traced_length(plan_)
    if length is None or length < 2:
        return
    t = length // 2
    args, kwargs = _shorter(tuple(example_args), dict(example_kwargs or {}), length, t)
    with torch.no_grad():
        ref, _ = pytree.tree_flatten(model(*args, **kwargs))
        flat = flatten_inputs(plan_.graph, args, kwargs)
        if follows(plan_) and t >= 2:
            bad = _differences(list(run_plan(flat)), ref, close)
            if not bad:
                return
            # Plan is frozen; as with padding below, what verify learned about shorter steps is set past the freeze
            object.__setattr__(plan_, "_following_refused", f"at {t} positions the plan changes the model's "
                                                            f"{', '.join(bad)}")
        padded, t = pad_to_traced(flat, plan_)  # t: the example's if shorter
        if t is None:
            return
        outs = outputs_cut(plan_, t)(list(run_plan(padded)))
    bad = _differences(outs, ref, close)
    if not bad:
        return
    why = (f"padding a sequence of {t} positions to the traced {length} changes the model's "
           f"{', '.join(bad)}: a real position reads a padded one (a model that is not causal, called without an "
           "attention_mask), so a plan traced at a fixed length cannot serve shorter sequences exactly ([Note: "
           "padding to the traced length] in fxsplit.api.padding). Plan with pad_sequence=False (only the traced "
           "length runs) or dynamic_sequence=True (a symbolic sequence), or pass the model its attention_mask")
    if strict:
        raise VerificationError(why)
    # Plan is frozen (what the user inspects does not change under them); this mark is not part of
    # the plan's meaning, only what verify learned about shorter steps, so it is set past the freeze
    object.__setattr__(plan_, "_padding_refused", why)
