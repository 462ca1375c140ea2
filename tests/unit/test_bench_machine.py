"""The machine record every benchmark report carries (benchmarks/machine.py): CPU model, cores,
and whether the usable cores are SMT siblings, read from /proc and /sys."""

from __future__ import annotations

from pathlib import Path

from benchmarks import envelope
from benchmarks.machine import cpu_list, cpu_model, machine_line, machine_record, smt_groups


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return root


def test_cpu_lists_and_the_model_name():
    assert cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_list("5") == [5]
    info = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8375C\nflags\t: fpu\n"
    assert cpu_model(info) == "Intel(R) Xeon(R) Platinum 8375C"


def test_two_hyperthreads_of_one_core_are_smt_siblings(tmp_path):
    root = _topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert smt_groups([0, 2], root) == [[0, 2]]  # one physical core
    assert smt_groups([0, 1], root) == [[0], [1]]  # two cores, one thread each
    assert smt_groups([0, 1, 2, 3], root) == [[0, 2], [1, 3]]
    assert smt_groups([7], root) is None  # unreadable: unknown, not "no"


def test_every_report_says_what_machine_it_ran_on():
    rec = machine_record()
    assert rec["usable_cpus"] >= 1 and rec["logical_cpus"] >= rec["usable_cpus"]
    assert rec["smt_siblings"] in (True, False, None)
    line = machine_line(rec)
    assert line.startswith("machine: ") and "physical cores" in line
    report = envelope("x", True, rows=[])
    assert report["machine"]["usable_cpus"] == rec["usable_cpus"] and report["versions"]
    own = envelope("x", True, machine={"extra": 1})  # a benchmark's own record is kept
    assert own["machine"] == {"extra": 1}
