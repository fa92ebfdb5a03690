"""The command context and the error-to-exit-code mapping (fedbayes.cli.base), without running anything."""

import contextlib

from fedbayes.cli.base import CommandContext, describe_failure
from fedbayes.errors import EXIT_INTERRUPTED, EXIT_UNEXPECTED, DivergedError
from fedbayes.runs import folder


def test_an_interrupt_names_what_resumes_it(tmp_path):
    assert describe_failure(KeyboardInterrupt()) == (EXIT_INTERRUPTED, "interrupted")  # outside any command
    with contextlib.ExitStack() as stack:
        ctx = CommandContext(stack, folder=tmp_path / "run")
        code, line = describe_failure(KeyboardInterrupt(), ctx)
        assert (
            code == EXIT_INTERRUPTED and line == f"interrupted; `fedbayes resume {tmp_path / 'run'}` continues from the start (no checkpoint was written yet)"
        )
        (tmp_path / "run" / folder.CHECKPOINTS).mkdir(parents=True)
        (tmp_path / "run" / folder.CHECKPOINTS / folder.checkpoint_name(4)).write_bytes(b"")
        ctx.resume_target = tmp_path  # a run of a comparison or sweep: resuming that continues it
        code, line = describe_failure(KeyboardInterrupt(), ctx)
        assert line == f"interrupted; `fedbayes resume {tmp_path}` continues it ({tmp_path / 'run'} from its checkpoint round_000004.npz)"


def test_failures_are_one_line_with_their_kind(tmp_path):
    with contextlib.ExitStack() as stack:
        ctx = CommandContext(stack, folder=tmp_path)
        assert describe_failure(DivergedError("round 3: nll non-finite"), ctx) == (3, "diverged: round 3: nll non-finite")
        code, line = describe_failure(ZeroDivisionError("deep\ninside"), ctx)
        assert code == EXIT_UNEXPECTED and line.startswith("internal error: ZeroDivisionError: deep inside;")
        assert str(tmp_path / folder.ERROR_LOG) in line and "ZeroDivisionError" in (tmp_path / folder.ERROR_LOG).read_text()


def test_the_context_holds_its_locks_until_the_command_ends(tmp_path):
    from fedbayes.runs import runlock

    with contextlib.ExitStack() as stack:
        CommandContext(stack).hold(tmp_path, "compare")
        assert (tmp_path / runlock.LOCK_NAME).exists()
    with runlock.hold(tmp_path):  # released: another holder gets it
        pass
