"""What tests need, for fxsplit's own and for users checking their own models.

Owns the multi-process harness (``harness``: ``run_distributed`` runs one function on every rank
of a fresh gloo group, failing fast and naming the rank), the model zoo (``zoo``: MLP, GPT with
tied weights, CNN with residuals, long skips, keyword arguments), Hugging Face models built
from small configs (``hf_zoo``) and the tensor-parallel coverage matrix (``tp_coverage``: tiny
transformers architectures and what automatic TP does with each, checked by ``fxsplit.verify``)
and ``trace_cache`` (``shared_traces``: plan one model several ways from one trace;
``shared_plans``: a launch's ranks take the plans its ``prepare`` made before they forked) and
``stage_inputs`` (every stage's inputs of a plan, in one process).

May import every layer (it sits beside the API, at the top); nothing in fxsplit imports it.
"""

from fxsplit.testing.harness import DistributedRunError, run_distributed

__all__ = ["DistributedRunError", "run_distributed"]
