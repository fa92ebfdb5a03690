"""fedbayes bench's progress: a bar per measurement on a terminal, replaced by its line as it ends;
plain lines elsewhere."""

import io

from rich.console import Console

from fedbayes.cli.progress import BenchProgress


def test_a_bench_step_is_a_bar_on_a_terminal_then_its_line():
    out = io.StringIO()
    progress = BenchProgress(echo=lambda line: out.write("echoed " + line), on=Console(file=out, force_terminal=True, width=100))
    step = progress("repeat 1/3  fedavg_10         ")
    step.update(0, 20)
    step.update(12, 20)
    (task,) = progress.progress.tasks
    assert (task.description, task.completed, task.total) == ("repeat 1/3 fedavg_10", 12, 20)
    step.finish("12,345 examples/s  (3.1 s)")
    assert progress.progress.tasks == []
    progress("paired        fedavg_10 + fedep_10")  # reports no rounds: a bar without a total
    assert progress.progress.tasks[0].total is None
    progress.close()
    text = out.getvalue()
    assert "repeat 1/3  fedavg_10          12,345 examples/s  (3.1 s)" in text and "echoed" not in text


def test_off_a_terminal_each_bench_step_is_one_line_when_it_ends():
    lines = []
    progress = BenchProgress(echo=lines.append, on=Console(file=io.StringIO(), force_terminal=False))
    step = progress("repeat 1/1  fedavg")
    step.update(1, 2)
    assert lines == []
    step.finish("10 examples/s  (0.1 s)")
    progress.close()
    assert lines == ["repeat 1/1  fedavg 10 examples/s  (0.1 s)"]
