"""fxsplit: split an unmodified PyTorch model across devices, as an fx graph compiler.

Data flows one way, through subpackages named after their layer::

             hardware/  what one device, its node and its links can do (presets, measure)
    model -> graph/     trace (fx or torch.export), node metadata, op vocabulary, cost model,
                        profile, pass manager, inspection
          -> tp/        tensor-parallel plan, sharding propagation, shard specs, collectives
             pipeline/  exact balanced partition, split plan, stage graphs, communication plan
          -> passes/    the built-in passes (tensor_parallel, pipeline_split), on the public API only
          -> schedule/  pipeline schedules as data: IR, builders, validation, simulation (torch-free)
          -> runtime/   one rank: executor, p2p channel, microbatching, mesh, failures
             planner/   the auto-planner: workload (traced once), candidate space, scoring, search
          -> api/       options, Plan, plan(), parallelize(), ParallelModel, checkpoints
    beside the API: testing/ (run_distributed, model zoos), cli

[Note: layer contract]
A module may import from its own subpackage and from the subpackages :data:`LAYERS` puts below
its own (transitively), never from above: ``schedule`` imports only ``errors``; ``graph`` knows no
parallelism; ``tp`` and ``pipeline`` do not import each other; passes never import the runtime
or the API; the runtime runs what the plan holds and never plans; nothing imports ``testing``
or the ``cli``. ``errors`` (every exception, under :class:`FxsplitError`) and ``config`` (the
environment switches) sit at the bottom. The package itself (this file) is the top: no module
inside fxsplit imports ``fxsplit`` bare. ``tests/test_public_api_boundary.py`` parses every
import and enforces this, and that ``passes/`` uses only :data:`PUBLIC_MODULES` (no private
names), exactly like a user's own pass.
"""

__version__ = "0.1.0"


def _passes_from_checkout() -> None:
    """[Note: passes from a checkout]: the built-in passes live in the folder ``passes/`` beside this
    package and ship as ``fxsplit.passes`` (pyproject.toml's ``package-dir``), which an installed
    fxsplit finds. Run from a plain checkout with nothing installed (``PYTHONPATH=<checkout>``, as
    ``make gpu-check`` runs on a machine with its own torch and no network), no installer maps that
    name, so a finder for ``fxsplit.passes`` alone points it at the folder beside this package; it
    goes first, so a checkout never runs the passes of another copy installed in editable mode."""
    import importlib.abc
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    beside = os.path.join(os.path.dirname(here), "passes")
    if os.path.isdir(os.path.join(here, "passes")) or not os.path.isfile(os.path.join(beside, "__init__.py")) \
            or not os.path.isfile(os.path.join(os.path.dirname(here), "pyproject.toml")):
        return

    class PassesBeside(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001 -- the finder protocol
            if name != "fxsplit.passes":
                return None
            return importlib.util.spec_from_file_location(name, os.path.join(beside, "__init__.py"),
                                                          submodule_search_locations=[beside])

    if not any(type(f).__name__ == "PassesBeside" for f in sys.meta_path):
        sys.meta_path.insert(0, PassesBeside())


_passes_from_checkout()

# [Note: lazy package attributes] ``fxsplit --help`` and ``fxsplit schedule`` need no torch, and
# importing torch takes seconds: the public names load their module on first use (PEP 562).
_LAZY: dict[str, str] = {
    "NodeInfo": "fxsplit.graph.meta",
    "annotate_node": "fxsplit.graph.meta",
    "node_info": "fxsplit.graph.meta",
    "TraceError": "fxsplit.graph.trace",
    "trace": "fxsplit.graph.trace",
    "pipe_split": "fxsplit.graph.marker",
    "PassContext": "fxsplit.graph.pass_api",
    "PassManager": "fxsplit.graph.pass_api",
    "PassResult": "fxsplit.graph.pass_api",
    "register_pass": "fxsplit.graph.pass_api",
    "Hardware": "fxsplit.hardware",
    "ParallelConfig": "fxsplit.api",
    "ParallelModel": "fxsplit.api",
    "Plan": "fxsplit.api",
    "PlanError": "fxsplit.api",
    "RankFailedError": "fxsplit.api",
    "load_full_checkpoint": "fxsplit.api",
    "parallelize": "fxsplit.api",
    "plan": "fxsplit.api",
    "verify": "fxsplit.api",
    "CheckpointError": "fxsplit.errors",
    "FxsplitError": "fxsplit.errors",
    "VerificationError": "fxsplit.errors",
    "PassContractError": "fxsplit.errors",
}


_SUBMODULES = frozenset({"api", "cli", "config", "errors", "graph", "hardware", "passes", "pipeline", "planner", "runtime",
                         "schedule", "testing", "tp"})


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:  # ``import fxsplit; fxsplit.testing.zoo`` as when everything was imported eagerly
        return importlib.import_module(f"fxsplit.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fxsplit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


LAYERS: dict[str, tuple[str, ...]] = {
    # unit -> the units directly below it ([Note: layer contract]); imports may go down transitively
    "fxsplit.errors": (),
    "fxsplit.config": ("fxsplit.errors",),
    "fxsplit.schedule": ("fxsplit.errors",),
    "fxsplit.hardware": ("fxsplit.errors", "fxsplit.config"),
    "fxsplit.graph": ("fxsplit.errors", "fxsplit.config", "fxsplit.hardware"),
    "fxsplit.tp": ("fxsplit.graph",),
    "fxsplit.pipeline": ("fxsplit.graph", "fxsplit.schedule"),
    "fxsplit.passes": ("fxsplit.tp", "fxsplit.pipeline"),
    "fxsplit.runtime": ("fxsplit.tp", "fxsplit.pipeline"),
    "fxsplit.planner": ("fxsplit.tp", "fxsplit.pipeline"),
    "fxsplit.api": ("fxsplit.runtime", "fxsplit.passes", "fxsplit.planner"),
    "fxsplit.testing": ("fxsplit.api",),
    "fxsplit.cli": ("fxsplit.api",),
    "fxsplit.__main__": ("fxsplit.cli",),
}

# Modules a pass (ours or a user's) may import; everything else is internal.
PUBLIC_MODULES = (
    "fxsplit",
    "fxsplit.errors",
    "fxsplit.graph",
    "fxsplit.graph.meta",
    "fxsplit.graph.ops",
    "fxsplit.graph.trace",
    "fxsplit.graph.cost",
    "fxsplit.hardware",
    "fxsplit.graph.pass_api",
    "fxsplit.graph.inspection",
    "fxsplit.graph.marker",
    "fxsplit.graph.profile",
    "fxsplit.graph.recompute",
    "fxsplit.tp",
    "fxsplit.tp.collectives",
    "fxsplit.tp.context",
    "fxsplit.tp.ring",
    "fxsplit.tp.sharding",
    "fxsplit.tp.functional",
    "fxsplit.tp.plan",
    "fxsplit.tp.random",
    "fxsplit.tp.moe",
    "fxsplit.tp.experts",
    "fxsplit.pipeline",
    "fxsplit.pipeline.stage",
    "fxsplit.pipeline.partition",
    "fxsplit.pipeline.split",
    "fxsplit.schedule",
    "fxsplit.passes",
    "fxsplit.runtime",
    "fxsplit.runtime.mesh",
    "fxsplit.runtime.failures",
    "fxsplit.api",
    "fxsplit.api.model",
    "fxsplit.api.checkpoint",
    "fxsplit.testing",
    "fxsplit.testing.zoo",
    "fxsplit.testing.hf_zoo",
    "fxsplit.cli",
)

# The names a user needs: plan and run a model, check it, write a pass, catch what fxsplit raises.
# Everything else is imported from its module (fxsplit.schedule, fxsplit.pipeline.stage,
# fxsplit.graph.cost, fxsplit.runtime, fxsplit.testing, fxsplit.errors, ...).
__all__ = [
    "plan",
    "parallelize",
    "verify",
    "trace",
    "pipe_split",
    "ParallelConfig",
    "Plan",
    "ParallelModel",
    "Hardware",
    "load_full_checkpoint",
    "PassContext",
    "PassManager",
    "PassResult",
    "register_pass",
    "NodeInfo",
    "node_info",
    "annotate_node",
    "FxsplitError",
    "PlanError",
    "TraceError",
    "VerificationError",
    "RankFailedError",
    "CheckpointError",
    "PassContractError",
]
