"""Read nccl-tests logs (`all_reduce_perf`, `all_gather_perf`, ...) into calibration measurements.

What is read: the header's ``#  Rank  3 Group  0 Pid 1234 on HOST device 3 [...] NAME`` lines (ranks,
hosts -> nodes, GPU name), the column header line (``size count type redop root time algbw busbw
#wrong time ...``, any nccl-tests version: columns are located by name) and the table rows. Every row
gives one `Measurement`: size = the ``size`` column (nccl-tests prints max(send, receive) bytes: the
buffer for all_reduce, the output for all_gather, the input for reduce_scatter, the message for
sendrecv, which is the cost model's convention), time = the median of its ``time`` columns
(out-of-place and in-place, microseconds). Several tests in one file are split at their
``# nccl-tests version`` / ``# Collective test starting: X`` / ``# nThread`` lines; a test without
the "Collective test starting" line (nccl-tests < 2.17) is named by its file name
(``all_reduce_perf*.log``). ``mpirun --tag-output`` prefixes (``[1,0]<stdout>:``) are stripped.

Limitations: the table is taken at face value (rows with a non-zero #wrong are not dropped; the
time is the nccl-tests average over iterations); sendrecv_perf's ring of pairs is modelled as one
pair, crossing nodes when the run spans nodes (the slowest pair sets the time); alltoallv, hypercube
and other tests without a cost-model formula are refused by name.

`nccl_tests_fit(dir)` / `fit_from_nccl_tests(dir)` fit a profile to a folder of such logs.

Pure: stdlib + the cost layer (numpy through the fit).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from prism_plugin.config.errors import ConfigError
from prism_plugin.config.kinds import OpKind
from prism_plugin.cost.calibrate import CalibrationFit, Measurement, fit_profile
from prism_plugin.cost.model import GroupPlacement
from prism_plugin.cost.profiles import HardwareProfile, load_profile

__all__ = [
    "NcclTestsRun",
    "TEST_KINDS",
    "fit_from_nccl_tests",
    "load_nccl_tests_dir",
    "nccl_tests_fit",
    "parse_nccl_tests",
]

TEST_KINDS: dict[str, OpKind] = {
    "all_reduce_perf": OpKind.ALL_REDUCE,
    "all_gather_perf": OpKind.ALL_GATHER,
    "reduce_scatter_perf": OpKind.REDUCE_SCATTER,
    "broadcast_perf": OpKind.BROADCAST,
    "reduce_perf": OpKind.REDUCE,
    "alltoall_perf": OpKind.ALL_TO_ALL,
    "gather_perf": OpKind.GATHER,
    "scatter_perf": OpKind.SCATTER,
    "sendrecv_perf": OpKind.SEND,
}
"""The nccl-tests binaries whose tables can be fitted, and the op each one times."""

_FILE_TEST = re.compile("(" + "|".join(t.removesuffix("_perf") for t in TEST_KINDS) + ")_perf")
_TAG = re.compile(r"^\[[^\]]*\]<std(?:out|err)>:")
_RANK = re.compile(r"#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s*(.*)")


@dataclass(frozen=True, kw_only=True, slots=True)
class NcclTestsRun:
    """One nccl-tests table: which test, on which ranks and hosts, and its (size, times) rows."""

    test: str
    """The binary, e.g. ``all_reduce_perf``."""
    kind: OpKind
    source: str
    """File (and section number when a file holds several tests)."""
    ranks_per_host: tuple[tuple[str, int], ...]
    """(hostname, number of ranks on it), in order of first appearance."""
    device: str
    """The GPU name of rank 0's line, e.g. ``NVIDIA H100 80GB HBM3``."""
    rows: tuple[tuple[int, tuple[float, ...]], ...]
    """(size_bytes, (time_us out-of-place, time_us in-place ...)) per table row."""

    @property
    def num_ranks(self) -> int:
        return sum(n for _, n in self.ranks_per_host)

    @property
    def num_nodes(self) -> int:
        return len(self.ranks_per_host)

    @property
    def placement(self) -> GroupPlacement:
        """The placement of the whole job's ranks (the group every collective of the test runs on)."""
        counts = [n for _, n in self.ranks_per_host]
        return GroupPlacement(size=sum(counts), num_nodes=len(counts), max_ranks_per_node=max(counts),
                              min_ranks_per_node=min(counts))

    def measurements(self) -> list[Measurement]:
        """One `Measurement` per row (send/recv: one pair, on two nodes when the run spans nodes)."""
        if self.kind is OpKind.SEND:
            crosses = self.num_nodes > 1
            pl = GroupPlacement(size=2, num_nodes=2 if crosses else 1, max_ranks_per_node=1 if crosses else 2,
                                min_ranks_per_node=1 if crosses else 2)
        else:
            pl = self.placement
        return [
            Measurement(kind=self.kind, size_bytes=size, placement=pl, time_us=statistics.median(times),
                        samples_us=times, source=self.source)
            for size, times in self.rows
        ]


class _Section:
    def __init__(self) -> None:
        self.name: str | None = None
        self.nthread = False
        self.ranks: list[tuple[int, str, str]] = []
        self.header: list[str] | None = None
        self.rows: list[tuple[int, tuple[float, ...]]] = []


def parse_nccl_tests(text: str, *, source: str = "<string>") -> list[NcclTestsRun]:
    """Every nccl-tests table in `text` (one log, possibly several tests); [] if there is none.

    `source` names the text in messages and, when a test has no "Collective test starting" line, its
    file name names the test (``all_gather_perf.node1.log``). Raises ConfigError for a table it cannot
    attribute to a test or to ranks, and for tests without a cost-model formula.
    """
    sections: list[_Section] = []
    cur: _Section | None = None
    for raw in text.splitlines():
        line = _TAG.sub("", raw.strip()).strip()
        if not line:
            continue
        if re.match(r"#\s*nccl-tests version", line):
            if cur is None or cur.nthread or cur.rows:
                cur = _Section()
                sections.append(cur)
            continue
        m = re.match(r"#\s*Collective test starting:\s*(\S+)", line)
        if m:
            if cur is None or cur.name or cur.nthread or cur.rows:
                cur = _Section()
                sections.append(cur)
            cur.name = m.group(1)
            continue
        if re.match(r"#\s*nThread\s+\d+", line):
            if cur is None or cur.nthread or cur.rows:
                cur = _Section()
                sections.append(cur)
            cur.nthread = True
            continue
        if cur is None:
            continue
        m = _RANK.match(line)
        if m:
            cur.ranks.append((int(m.group(1)), m.group(2), m.group(3).strip()))
            continue
        if line.startswith("#"):
            tokens = line.lstrip("#").split()
            if "size" in tokens and "time" in tokens:
                cur.header = tokens
            continue
        tokens = line.split()
        if cur.header is None or not tokens[0].isdigit() or len(tokens) != len(cur.header):
            continue  # NCCL INFO lines, MPI warnings, truncated rows
        size = int(tokens[cur.header.index("size")])
        parsed = (_float(tokens[i]) for i, t in enumerate(cur.header) if t == "time")
        times = tuple(x for x in parsed if x is not None and x > 0)
        if size > 0 and times:
            cur.rows.append((size, times))
    runs = []
    many = sum(1 for s in sections if s.rows) > 1
    for index, sec in enumerate(s for s in sections if s.rows):
        where = f"{source} (test {index + 1})" if many else source
        runs.append(_run(sec, where, source))
    return runs


def _run(sec: _Section, where: str, source: str) -> NcclTestsRun:
    name = sec.name
    if name is None:
        m = _FILE_TEST.search(Path(source).name)
        if m is None:
            raise ConfigError(
                f"{where}: a table without a '# Collective test starting: NAME' line and a file name that names "
                f"no test; rename the file after the binary (e.g. all_reduce_perf.log); known: {', '.join(TEST_KINDS)}"
            )
        name = m.group(0)
    kind = TEST_KINDS.get(name)
    if kind is None:
        raise ConfigError(
            f"{where}: nccl-tests test {name!r} has no cost-model formula; fit from {', '.join(TEST_KINDS)} "
            "(remove or rename this log)"
        )
    if not sec.ranks:
        raise ConfigError(
            f"{where}: no '#  Rank N Group G Pid P on HOST device D' lines: cannot tell ranks and nodes; "
            "keep the whole nccl-tests output, header included"
        )
    ranks = [r for r, _, _ in sec.ranks]
    dup = [r for r, n in Counter(ranks).items() if n > 1]
    if dup:
        raise ConfigError(
            f"{where}: rank {dup[0]} is listed more than once: each process ran its own job (nccl-tests built "
            "without MPI under mpirun); rebuild nccl-tests with MPI=1 and rerun"
        )
    hosts: dict[str, int] = {}
    for _, host, _ in sorted(sec.ranks):
        hosts[host] = hosts.get(host, 0) + 1
    if len(ranks) < 2:
        raise ConfigError(f"{where}: a 1-rank run times nothing the cost model has (a 1-rank group costs 0)")
    return NcclTestsRun(test=name, kind=kind, source=where, ranks_per_host=tuple(hosts.items()),
                        device=sorted(sec.ranks)[0][2], rows=tuple(sec.rows))


def _float(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def load_nccl_tests_dir(directory: str | Path) -> tuple[list[NcclTestsRun], list[Path]]:
    """Parse every ``*.log`` / ``*.txt`` / ``*.out`` file under `directory` (recursively, sorted).

    Returns (runs, files that held no nccl-tests table). Raises ConfigError when the directory is
    missing or holds no table at all.
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--from-nccl-tests: {str(root)!r} is not a directory of nccl-tests logs")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".log", ".txt", ".out"))
    runs: list[NcclTestsRun] = []
    empty: list[Path] = []
    for path in files:
        found = parse_nccl_tests(path.read_text(encoding="utf-8", errors="replace"), source=str(path))
        runs.extend(found)
        if not found:
            empty.append(path)
    if not runs:
        raise ConfigError(
            f"--from-nccl-tests: no nccl-tests table in the {len(files)} .log/.txt/.out files under {str(root)!r}; "
            "save each test's full output there (e.g. all_reduce_perf -b 8 -e 8G -f 2 > all_reduce_perf.log)"
        )
    return runs, empty


# -- fit ----------------------------------------------------------------------------------

_DEVICE_BASES = (("H100", "dgx-h100"), ("H200", "dgx-h200"), ("H800", "dgx-h100"), ("B200", "dgx-b200"),
                 ("A100", "dgx-a100"), ("A800", "dgx-a100"))


def nccl_tests_fit(
    directory: str | Path, *, base: HardwareProfile | str | None = None, name: str | None = None
) -> CalibrationFit:
    """Fit a profile to the nccl-tests logs under `directory` (see `prism_plugin.cost.nccl_tests`).

    Single-node runs fit the intra-node tier, overheads and efficiencies; multi-node runs (the header's
    Rank lines name several hosts) fit the inter-node latency and bandwidth. `base` (a profile or its
    name) gives the intra-node link rate the efficiencies are relative to and the values of parameters
    the logs do not determine; None picks it from the GPU name in the logs (H100 -> dgx-h100, H200 ->
    dgx-h200, B200 -> dgx-b200, A100 -> dgx-a100), else no base (fitted rates become link rates; unmeasured
    figures are tied).
    gpus_per_node = the most ranks any log puts on one host.
    """
    runs, _ = load_nccl_tests_dir(directory)
    if isinstance(base, str):
        base = load_profile(base)
    if base is None:
        devices = {r.device for r in runs}
        picks = {b for d in devices for key, b in _DEVICE_BASES if key in d}
        base = load_profile(picks.pop()) if len(picks) == 1 else None
    gpus_per_node = max(n for r in runs for _, n in r.ranks_per_host)
    tests = sorted({f"{r.test} ({r.num_ranks} ranks, {r.num_nodes} node{'s' if r.num_nodes > 1 else ''})"
                    for r in runs})
    description = (
        f"Fitted by prism calibrate from nccl-tests logs in {str(directory)!r}: {', '.join(tests)}; "
        f"GPU {', '.join(sorted({r.device for r in runs}))}."
        + (f" Intra-node link rate from {base.name!r}; efficiencies relative to it." if base is not None else
           " No base profile: the faster fitted intra-node rate is taken as the link rate.")
    )
    measurements = [m for r in runs for m in r.measurements()]
    return fit_profile(measurements, name=name or f"nccl-tests-{Path(directory).name}", description=description,
                       gpus_per_node=gpus_per_node, link_rates=base, fallback=base)


def fit_from_nccl_tests(
    directory: str | Path, *, base: HardwareProfile | str | None = None, name: str | None = None
) -> HardwareProfile:
    """The profile of `nccl_tests_fit` (residuals in its description)."""
    return nccl_tests_fit(directory, base=base, name=name).profile
