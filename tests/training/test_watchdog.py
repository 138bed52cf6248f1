"""A stalled rank is named, every waiting rank reports what it waited for, and all ranks end.

Each case runs the real launcher (``python -m megatron_zb.testing.stall``: ``megatron-zb train
--cpu`` with one rank sleeping at a chosen point) with a 4 s timeout, and checks the report:
the stalled rank is the one named, each other rank waited at most the timeout + 10 s in the
collective or transfer it was blocked on, and the run ends with exit code 1 well before the stall
(120 s) would have: about 6 s here, up to 26 s on a loaded CI machine (the launcher's SIGTERM
grace and the interpreters' exit count too), hence the END_S bound. The last case interrupts a run
with SIGINT. Stalls in the grad-norm all-reduce and in a save, by sleep and by SIGSTOP, under our schedules
and megatron-core's, are drawn by test_stall_property.py.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_zb.training.supervise import stalled_ranks, stuck_too_long, timeout_report
from megatron_zb.training.watchdog import describe

TIMEOUT_S = 4.0
END_S = TIMEOUT_S + 40  # the stall lasts 120 s: a run ending by then was ended by the watchdog
MODEL = (
    "--cpu --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 --mock-data "
    "--micro-batch-size 2 --lr 3e-3 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7"
)
LINE = re.compile(r"^  rank (\d+): (.*)$", re.MULTILINE)


def stalled_run(tmp_path: Path, flags: str, **fault) -> tuple[subprocess.CompletedProcess, dict[int, str], float]:
    """Run with the fault; returns the result, each rank's report line, and the seconds from stall to exit."""
    mark = tmp_path / "stalled"
    fault = {"seconds": 120, "mark": str(mark), "timeout_s": TIMEOUT_S, **fault}
    command = [sys.executable, "-m", "megatron_zb.testing.stall", json.dumps(fault), *MODEL.split(), *flags.split()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    ended = time.time()
    assert mark.exists(), f"the stall was never reached:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    lines = {int(rank): text for rank, text in LINE.findall(done.stderr)}
    return done, lines, ended - float(mark.read_text())


def waited(line: str) -> float:
    found = re.search(r"waited (\d+\.\d) s \(timeout (\S+) s\)", line)
    assert found, line
    assert float(found.group(2)) == TIMEOUT_S
    return float(found.group(1))


def check_report(done, lines: dict[int, str], seconds: float, stalled: int, world_size: int) -> None:
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"megatron-zb train: timeout: rank {stalled} stalled: no progress while" in done.stderr, done.stderr
    assert sorted(lines) == list(range(world_size)), done.stderr
    assert lines[stalled].startswith("STALLED, no progress for "), lines[stalled]
    for rank, line in lines.items():
        if rank != stalled:
            assert 0 < waited(line) <= TIMEOUT_S + 10, line
    assert f"megatron-zb train: ended all {world_size} ranks" in done.stderr
    assert seconds <= END_S, f"{seconds:.1f} s from the stall to the end of the run"
    assert "Traceback" not in done.stderr, done.stderr


def test_stall_mid_pipeline_at_pp4_names_the_stalled_rank_not_its_neighbour(tmp_path: Path) -> None:
    flags = (
        "--pipeline-model-parallel-size 4 --global-batch-size 16 --train-iters 3 --pipeline-schedule zb-h1 "
        f"--zero-bubble-p2p-timeout {TIMEOUT_S}"
    )
    done, lines, seconds = stalled_run(tmp_path, flags, rank=2, at="pass", match="F s2 mb3", iteration=2)
    check_report(done, lines, seconds, stalled=2, world_size=4)
    assert "iteration 2, F s2 mb3" in lines[2], lines[2]
    assert "in pipeline rank 3 receiving activation for F s3 mb3 from pipeline rank 2" in lines[3], lines[3]
    assert "from pipeline rank 2" in lines[1], lines[1]  # the gradient it needs next


def test_stall_in_a_p2p_send(tmp_path: Path) -> None:
    flags = (
        "--pipeline-model-parallel-size 2 --global-batch-size 8 --train-iters 3 --pipeline-schedule zb-h1 "
        f"--zero-bubble-p2p-timeout {TIMEOUT_S}"
    )
    fault = {"rank": 0, "at": "send", "match": "activation of F s0 mb2", "iteration": 2}
    done, lines, seconds = stalled_run(tmp_path, flags, **fault)
    check_report(done, lines, seconds, stalled=0, world_size=2)
    assert "stalled_post" in lines[0], lines[0]
    assert "in pipeline rank 1 receiving activation for F s1 mb2 from pipeline rank 0" in lines[1], lines[1]
    assert "P2PTimeoutError" in lines[1], lines[1]


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigint_ends_every_rank(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "megatron_zb", "train", *MODEL.split(),
        "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "1000",
    ]  # fmt: skip
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in launcher.stdout:  # wait until training runs
            if "iteration        2/" in line:
                break
        # the ranks are forks of the launcher's fork server (training.spawn.start_ranks)
        servers = [pid for pid in children(launcher.pid) if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        ranks = [pid for server in servers for pid in children(server)]
        sent = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(timeout=30)
        seconds = time.monotonic() - sent
        stderr = launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert code == 130, stderr
    assert "megatron-zb train: SIGINT received: ended all 2 ranks" in stderr, stderr
    assert seconds < 20  # 1000 iterations would take minutes
    assert len(ranks) == 2 and not [pid for pid in ranks if alive(pid)]


# -- the report alone, from records as ranks publish them ------------------------------------------


def record(rank: int, progress: float, wait: dict | None = None, **extra) -> dict:
    base = {"rank": rank, "time": 100.0, "iteration": 7, "pass": None, "where": "", "progress_time": progress}
    return {**base, "wait": wait, "failed": None, **extra}


def test_report_names_the_rank_without_progress_not_the_first_to_time_out() -> None:
    wait = {"what": "all_reduce on the pipeline group (ranks 0, 1, 2)", "since": 94.0, "timeout_s": 5.0, "peers": []}
    records = {
        0: record(0, 94.0, wait),
        1: record(1, 93.0, **{"pass": "F s1 mb3"}),  # computing since 93: stalled
        2: record(2, 94.5, {**wait, "since": 94.5}),
    }
    assert stalled_ranks(records, 3, now=100.0) == [1]
    report = timeout_report(records, 4, now=100.0)
    assert report.splitlines() == [
        "megatron-zb train: timeout: ranks 1, 3 stalled: no progress while 2 ranks waited for them",
        "  rank 0: waited 6.0 s (timeout 5 s) in all_reduce on the pipeline group (ranks 0, 1, 2), iteration 7",
        "  rank 1: STALLED, no progress for 7.0 s, iteration 7, F s1 mb3",
        "  rank 2: waited 5.5 s (timeout 5 s) in all_reduce on the pipeline group (ranks 0, 1, 2), iteration 7",
        "  rank 3: STALLED, published no status (never reached training)",
    ]
    busy = record(1, 99.9)
    assert describe(busy, 100.0) == "rank 1: busy, iteration 7"
    assert stalled_ranks({**records, 1: busy}, 3, now=100.0) == []


def test_a_rank_without_progress_past_the_timeout_triggers_the_report_before_any_wait_runs_out() -> None:
    """Counted from the stalled rank's last progress: the others reached their wait later (a loaded machine)."""
    wait = {"what": "P2P with ranks 1", "since": 97.5, "timeout_s": 5.0, "peers": []}
    records = {0: record(0, 97.5, wait), 1: record(1, 92.5, **{"pass": "F s1 mb3"})}
    assert 100.0 - wait["since"] < wait["timeout_s"] + 2  # no wait is overdue yet
    assert stuck_too_long(records, now=100.0, limit_s=7.0)  # 7.5 s without progress, rank 0 waited 2.5 s of 5
    just_began = {0: record(0, 99.9, {**wait, "since": 99.9}), 1: records[1]}
    assert not stuck_too_long(just_began, now=100.0, limit_s=7.0)  # rank 1 may still be starting up
    assert not stuck_too_long(records, now=99.0, limit_s=7.0)  # 6.5 s
    assert not stuck_too_long({1: records[1]}, now=100.0, limit_s=7.0)  # nobody waits for it
    done = {**records[1], "done": True}
    assert not stuck_too_long({0: records[0], 1: done}, now=100.0, limit_s=7.0)
    assert stalled_ranks(records, 2, now=100.0) == [1]


def test_a_silent_heartbeat_names_the_rank_that_went_quiet_first_whatever_its_last_record_says() -> None:
    """SIGSTOP stops the heartbeat thread too: the last record may even show a wait; the launcher's clock decides."""
    from megatron_zb.training.supervise import Heartbeats

    wait = {"what": "recv from rank 1", "since": 95.0, "timeout_s": 5.0, "peers": [1]}
    records = {
        0: record(0, 95.0, wait, beat=40),
        1: record(1, 94.0, {**wait, "what": "P2P with ranks 0, 2 (2 transfers)"}, beat=31, **{"pass": "B s1 mb2"}),
        2: record(2, 95.0, {**wait, "what": "recv from rank 1"}, beat=12),
    }
    beats = Heartbeats(quiet_s=2.0, frozen_s=60.0)
    beats.update(records, now=1000.0)
    records[0]["beat"], records[2]["beat"] = 41, 13  # ranks 0 and 2 beat on; rank 1 does not
    beats.update(records, now=1007.0)
    assert beats.quiet(records, now=1007.0) == {}, "a silent but running rank counts only after the timeout"
    assert beats.quiet(records, now=1068.0) == {0: 1007.0, 1: 1000.0, 2: 1007.0}  # all frozen: rank 1 went first
    quiet = beats.quiet(records, now=1007.0, stopped={1})  # the OS says rank 1's process is stopped
    assert quiet == {1: 1000.0}
    assert stalled_ranks(records, 3, now=101.0, quiet=quiet) == [1]
    report = timeout_report(records, 3, now=101.0, quiet=quiet, clock=1007.0).splitlines()
    assert report[0] == (
        "megatron-zb train: timeout: rank 1 stalled: its heartbeat stopped 7.0 s ago (the launcher's clock: the "
        "process is stopped or frozen) while 2 ranks waited; last seen: waiting in P2P with ranks 0, 2 (2 transfers), "
        "iteration 7, B s1 mb2"
    )
    assert report[2].startswith("  rank 1: STALLED, silent for 7.0 s; last seen: waiting in P2P")
    records[1]["done"] = True  # a rank that finished stops beating without stalling
    assert beats.quiet(records, now=1007.0, stopped={1}) == {}


def test_a_run_past_its_deadline_is_ended_with_each_ranks_last_status(capsys) -> None:
    """Ranks busy without end and never waiting on a peer (Megatron-LM's data loader on an empty split): no timeout
    sees them; the deadline ends them and says where each was."""
    import multiprocessing

    import torch.distributed as dist

    from megatron_zb.training.supervise import supervise

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    begin = time.monotonic()
    code = supervise(ranks, store, lambda rank: "", [], deadline_s=1.0)
    assert code == 1 and time.monotonic() - begin < 30
    assert all(rank.exitcode is not None for rank in ranks)
    err = capsys.readouterr().err
    assert "megatron-zb train: deadline: no result after 1 s" in err
    assert "rank 1: published no status: still before training (building the model or the data)" in err
    assert "ended all 2 ranks" in err
