"""What the tests share besides fixtures (conftest.py), by concern; `from helpers import X` for any of them."""

from .baking import bake_command, bake_with_cli, build_wheel, import_hook
from .checkpoints import assert_bitwise_equal, assert_same, checkpoint, checkpoint_state, metric_rows
from .environment import BIN, REQUIRE_ALL, TEMPLATE_ROOT, free_port, require, run, tool_env
from .faults import kill_a_worker_and_finish, paused, stopped, worker_pids
from .jobs import (
    BARE,
    TINY_RUN,
    assert_trains_like_bare,
    bare_torchrun,
    flags,
    run_in_terminal,
    run_job,
    start_job,
    start_nodes,
    tiny_run,
    wait_for,
)
from .projects import (
    assert_project_tests_pass,
    main_in_this_process,
    make_image_folder,
    readme_block,
    smoke_test_args,
    task_field,
    with_task_code,
)

__all__ = [
    "TEMPLATE_ROOT",
    "BIN",
    "REQUIRE_ALL",
    "require",
    "tool_env",
    "run",
    "free_port",
    "start_nodes",
    "wait_for",
    "run_in_terminal",
    "flags",
    "TINY_RUN",
    "tiny_run",
    "BARE",
    "assert_trains_like_bare",
    "start_job",
    "run_job",
    "bare_torchrun",
    "paused",
    "stopped",
    "kill_a_worker_and_finish",
    "worker_pids",
    "import_hook",
    "bake_command",
    "bake_with_cli",
    "build_wheel",
    "make_image_folder",
    "assert_project_tests_pass",
    "smoke_test_args",
    "task_field",
    "readme_block",
    "with_task_code",
    "main_in_this_process",
    "checkpoint",
    "metric_rows",
    "assert_bitwise_equal",
    "assert_same",
    "checkpoint_state",
]
