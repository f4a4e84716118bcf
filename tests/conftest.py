"""[Note: heaviest files first]
``make test`` runs the files in pytest-xdist workers, one file per worker at a time
(``--dist loadfile``), handing the next file in collection order to whichever worker is free. A
heavy file handed out last keeps one worker busy while the other idles, so the files measured as
the heaviest (``pytest --durations``; the multi-process launches and Hugging Face traces) are
collected first and the light one-process files fill the gaps at the end. The list only orders;
a file missing from it runs after the listed ones, in its usual order.
"""

_HEAVIEST_FIRST = (
    "test_zero_bubble_dist.py", "test_tp_rules_views.py", "test_generate.py", "test_runtime_dist.py",
    "test_examples.py", "test_pipeline_split.py", "test_trace.py", "test_activation_checkpointing.py",
    "test_verify.py", "test_tp_mha.py", "test_tp_plan.py", "test_faults.py", "test_tp_coverage.py", "test_stage.py",
    "test_gpu_check.py", "test_tensor_parallel.py", "test_fsdp.py", "test_split_graph.py", "test_partition.py",
    "test_rng.py", "test_buffers_kept.py", "test_mixed_precision.py", "test_activation_checkpointing_dist.py",
)


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(_HEAVIEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's tests keep their order
