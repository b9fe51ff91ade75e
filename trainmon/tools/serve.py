"""``trainmon serve RUN_DIR``: the report's page and views over HTTP, each grid queried from the run when asked.

For runs too large for one static page (``trainmon report`` keeps the most telling grids within its size limit):
the same page, whose heatmaps come from JSON endpoints answered with DuckDB on the run's store (or its CSV files,
taken in once at start), so any family, metric, rank, step or module can be viewed and any step range zoomed into
down to full resolution. Standard library only (:mod:`http.server`), bound to 127.0.0.1 by default; nothing is
fetched from outside and only GET is answered. A request whose ``Host`` header names another host is refused (a web
page elsewhere cannot reach the server through DNS rebinding). Ctrl-C stops it.

Endpoints (all GET, JSON; a bad parameter is a 400 with ``{"error": "..."}``):

- ``/``: the page;
- ``/api/catalog``: families, metrics, ranks and steps;
- ``/api/grid?view=steps&family=F&metric=M&rank=R[&lo=A&hi=B]``: module x step of a rank (``lo``/``hi``: a step
  range, bucketed into at most ``--max-columns`` columns: one column per step once the range is that narrow);
- ``/api/grid?view=ranks&family=F&metric=M&step=S``: module x rank at the collected step nearest ``S``;
- ``/api/grid?view=module&family=F&metric=M&module=VPP:NAME[&lo=A&hi=B]``: rank x step of a row;
- ``/api/values?family=F&metric=M&module=VPP:NAME&rank=R[&rank_hi=R2]&lo=A&hi=B``: the stored values themselves
  (rank, step, micro-step, value; at most 1,000);
- ``/api/rows?family=F``: the family's rows, ordered and grouped; ``/api/curves?rank=R``: a rank's curves.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from trainmon.errors import UsageError
from trainmon.tools.analyse import add_detector_option, selected_detectors
from trainmon.tools.report import MAX_BYTES, Prepared, open_prepared, page_data, prepare
from trainmon.tools.report.colours import encode
from trainmon.tools.report.curves import curves
from trainmon.tools.report.grids import Grid, module_grids, rank_grids, step_grids
from trainmon.tools.report.page import render
from trainmon.tools.report.rows import RowSet, order_rows
from trainmon.tools.report.source import RunSource, identifier
from trainmon.tools.store_reader import StoreError

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

DEFAULT_PORT = 8050
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
MAX_VALUES = 1000
"""Values returned by ``/api/values`` at most."""


class BadRequest(ValueError):
    """A request parameter that is missing or wrong (a 400)."""


class Views:
    """The answers of the endpoints, from one run (thread-safe: queries go one at a time)."""

    def __init__(self, source: RunSource, data: dict[str, Any], columns: int) -> None:
        self.source, self.data, self.columns = source, data, columns
        self.page = render(data).encode("utf-8")
        self._rows: dict[str, dict[tuple[int, str], float]] = {}
        self._rowsets: dict[str, RowSet] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------- arguments
    def _family(self, query: dict[str, str]) -> str:
        family = query.get("family", "")
        if family not in self.source.families:
            raise BadRequest(f"family {family!r}: no such family (the run has {', '.join(self.source.families)})")
        return family

    def _metric(self, query: dict[str, str], family: str) -> str:
        metric = query.get("metric", "")
        metrics = self.source.families[family].metrics
        if metric not in metrics:
            raise BadRequest(f"metric {metric!r}: no such metric of {family} (it has {', '.join(metrics)})")
        return metric

    @staticmethod
    def _int(query: dict[str, str], key: str, default: int | None = None) -> int:
        text = query.get(key)
        if text is None or text == "":
            if default is None:
                raise BadRequest(f"{key}: missing")
            return default
        if not text.lstrip("-").isdigit() or len(text) > 19:
            raise BadRequest(f"{key} {text[:30]!r}: not an integer")
        return int(text)

    def _module(self, query: dict[str, str], family: str) -> tuple[int, str]:
        text = query.get("module", "")
        vpp, _, name = text.partition(":")
        if not vpp.isdigit() or not name:
            raise BadRequest(f"module {text[:80]!r}: expected VPP:NAME, e.g. 0:model.layers.3.mlp.up_proj.weight")
        key = (int(vpp), name)
        if key not in self.rows(family).index():
            found = self.source.query(f"SELECT 1 AS x FROM {identifier(family)} WHERE vpp_stage = ? AND name = ? "
                                      "LIMIT 1", [key[0], key[1]])
            if not len(found["x"]):
                raise BadRequest(f"module {text[:80]!r}: no such row of {family}")
        return key

    def _range(self, query: dict[str, str], family: str) -> tuple[int, int]:
        info = self.source.families[family]
        lo = max(info.first_step, self._int(query, "lo", info.first_step))
        hi = min(info.last_step, self._int(query, "hi", info.last_step))
        if hi < lo:
            raise BadRequest(f"steps {lo}..{hi}: empty (the family has steps {info.first_step}..{info.last_step})")
        return lo, hi

    # ------------------------------------------------------------------------------------------------------ rows
    def rows(self, family: str, grids: Sequence[Grid] = ()) -> RowSet:
        """The family's rows: those of its first rank's first step, and of every grid answered since."""
        with self._lock:
            known = self._rows.get(family)
            if known is None and grids:
                known = self._rows[family] = {}
            if known is None:
                info = self.source.families[family]
                rank = info.ranks[0]
                found = self.source.query(
                    f"SELECT vpp_stage, name, min(\"order\") AS first FROM {identifier(family)} WHERE rank = {rank} "
                    f"AND step = (SELECT min(step) FROM {identifier(family)} WHERE rank = {rank}) GROUP BY ALL")
                known = {(int(v), str(n)): float(f) for v, n, f in zip(found["vpp_stage"].tolist(),
                                                                       found["name"].tolist(), found["first"].tolist())}
                self._rows[family] = known
            added = False
            for grid in grids:
                for key, first in zip(grid.row_keys, grid.row_first):
                    if key not in known:
                        known[key] = first
                        added = True
            if added or family not in self._rowsets:
                self._rowsets[family] = order_rows(list(known), list(known.values()))
            return self._rowsets[family]

    # ------------------------------------------------------------------------------------------------- endpoints
    def grid(self, query: dict[str, str]) -> dict[str, Any]:
        view = query.get("view", "steps")
        family = self._family(query)
        metric = self._metric(query, family)
        info = self.source.families[family]
        if view == "steps":
            rank = self._int(query, "rank", info.ranks[0])
            if rank not in info.ranks:
                raise BadRequest(f"rank {rank}: no rows of {family} (ranks {info.ranks[0]}..{info.ranks[-1]})")
            lo, hi = self._range(query, family)
            grids = step_grids(self.source, family, [metric], [rank], lo, hi, self.columns, history=True)
        elif view == "ranks":
            step = self._nearest_step(family, self._int(query, "step", info.last_step))
            grids = rank_grids(self.source, family, [metric], [step])
        elif view == "module":
            module = self._module(query, family)
            lo, hi = self._range(query, family)
            grids = module_grids(self.source, family, [metric], [module], lo, hi, self.columns, history=True)
        else:
            raise BadRequest(f"view {view[:30]!r}: expected steps, ranks or module")
        if not grids:
            raise BadRequest(f"no rows of {family} {metric} in this view")
        grid = grids[0]
        if view == "module":
            return encode(grid, first=lo)
        rows = self.rows(family, grids)
        out = encode(grid.reordered(rows), first=lo if view == "steps" else None)
        out["rowset"] = rows.to_json()
        return out

    def _nearest_step(self, family: str, step: int) -> int:
        """The collected step of ``family`` nearest ``step`` (the earlier of two as near)."""
        table = identifier(family)
        found = self.source.query(
            f"SELECT step FROM (SELECT max(step) AS step FROM {table} WHERE step <= {step} UNION ALL "
            f"SELECT min(step) FROM {table} WHERE step >= {step}) WHERE step IS NOT NULL "
            f"ORDER BY abs(step - {step}), step LIMIT 1")
        if not len(found["step"]):
            raise BadRequest(f"{family} has no rows")
        return int(found["step"][0])

    def values(self, query: dict[str, str]) -> dict[str, Any]:
        family = self._family(query)
        metric = self._metric(query, family)
        vpp, name = self._module(query, family)
        lo, hi = self._range(query, family)
        rank = self._int(query, "rank")
        rank_hi = self._int(query, "rank_hi", rank)
        found = self.source.query(
            f"SELECT rank, step, micro_step, {identifier(metric)} AS value FROM {identifier(family)} "
            "WHERE vpp_stage = ? AND name = ? AND rank BETWEEN ? AND ? AND step BETWEEN ? AND ? "
            f"ORDER BY step, rank, micro_step LIMIT {MAX_VALUES + 1}", [vpp, name, rank, rank_hi, lo, hi])
        rows = [[int(r), int(s), int(m), _json_float(float(v))] for r, s, m, v in zip(
            found["rank"].tolist(), found["step"].tolist(), found["micro_step"].tolist(),  # numpy: no device
            found["value"].tolist())]
        return {"columns": ["rank", "step", "micro_step", metric], "rows": rows[:MAX_VALUES],
                "truncated": len(rows) > MAX_VALUES}

    def answer(self, path: str, query: dict[str, str]) -> tuple[int, str, bytes]:
        """``(status, content type, body)`` of a GET."""
        try:
            if path in ("/", "/index.html"):
                return 200, "text/html; charset=utf-8", self.page
            if path == "/api/catalog":
                return _json(200, self.data["catalog"])
            if path == "/api/grid":
                return _json(200, self.grid(query))
            if path == "/api/values":
                return _json(200, self.values(query))
            if path == "/api/rows":
                return _json(200, self.rows(self._family(query)).to_json())
            if path == "/api/curves":
                rank = self._int(query, "rank")
                if rank not in self.source.scalar_ranks:
                    raise BadRequest(f"rank {rank}: no scalars")
                return _json(200, curves(self.source, rank, 2 * self.columns))
            return _json(404, {"error": f"{path[:80]}: no such page"})
        except BadRequest as exc:
            return _json(400, {"error": str(exc)})
        except StoreError as exc:
            return _json(500, {"error": str(exc)})


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else ("nan" if math.isnan(value) else "inf" if value > 0 else "-inf")


def _json(status: int, body: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")


class Server(ThreadingHTTPServer):
    """An HTTP server for one run's :class:`Views` (``serve_forever`` answers; :meth:`stop` ends it)."""

    daemon_threads = True

    def __init__(self, views: Views, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.views = views
        # bound to the loopback: only requests for a loopback name (DNS rebinding); elsewhere, the user chose
        self.hosts: set[str] | None = set(LOOPBACK) if host in LOOPBACK else None

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A browser that went away mid-answer is no error; anything else is one line on stderr."""
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError)):
            print(f"trainmon serve: error answering {client_address[0]}: {error!r}", file=sys.stderr)

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``."""
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{name if ':' not in name else f'[{name}]'}:{port}/"

    def start(self) -> threading.Thread:
        """Answer on a thread of its own (tests, benchmarks)."""
        thread = threading.Thread(target=self.serve_forever, name="trainmon-serve", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop answering (from another thread than :meth:`serve_forever`'s) and close the socket."""
        self.shutdown()
        self.server_close()


def _host_name(header: str) -> str:
    """The host of a ``Host`` header without its port.

    Example:
        >>> _host_name("127.0.0.1:8050"), _host_name("[::1]:80"), _host_name("localhost")
        ('127.0.0.1', '[::1]', 'localhost')
    """
    if header.startswith("["):
        return header.split("]")[0] + "]"
    return header.rsplit(":", 1)[0]


class _Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        host = _host_name(self.headers.get("Host") or "")
        if self.server.hosts is not None and host not in self.server.hosts:
            refused = f"Host {host[:60]!r} refused: open the page at {self.server.url}"
            status, kind, body = _json(403, {"error": refused})
        else:
            query = {key: values[-1] for key, values in parse_qs(parts.query, keep_blank_values=True).items()}
            try:
                status, kind, body = self.server.views.answer(parts.path, query)
            except Exception as exc:  # a bug of ours: the browser is told, the server goes on
                print(f"trainmon serve: error answering {parts.path[:80]}: {exc!r}", file=sys.stderr)
                status, kind, body = _json(500, {"error": f"internal error: {exc!r}"[:300]})
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: no line per request."""


def open_views(run_dir: Path, max_columns: int = 1000, detectors: list[str] | None = None) -> Views:
    """The run, opened and summarised for serving (what ``trainmon serve`` does before it listens).

    Raises:
        UsageError: as ``trainmon report`` (not a run, a corrupt file, ...).
    """
    prepared: Prepared = prepare(run_dir, None, None, max_columns, detectors, "serve")
    source = open_prepared(prepared, None, lambda: None)
    try:
        data, _ = page_data(source, prepared, None, None, max_columns, MAX_BYTES, serve=True)
    except BaseException:
        source.close()
        raise
    return Views(source, data, max_columns)


def add_parser(sub: Subparsers) -> None:
    """Register ``serve`` on the ``trainmon`` command's subparsers."""
    parser = sub.add_parser(
        "serve", help="serve a run's report views over HTTP (every grid, at full resolution)",
        description="Serve the report of a run on http://127.0.0.1:PORT/: the page of trainmon report whose "
                    "heatmaps are queried from the run when asked (any family, metric, rank, step or module; zoom "
                    "into a step range down to single steps; the stored values of a cell). Bound to 127.0.0.1 "
                    "unless --host says otherwise; nothing is fetched from outside. Ctrl-C stops it.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (with rank*/ folders or a store/)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default 127.0.0.1: this machine only, and only pages opened "
                             "as 127.0.0.1 or localhost are answered; another address makes the run readable by "
                             "whoever reaches it)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
                        help=f"the port (default {DEFAULT_PORT}; 0: a free port)")
    parser.add_argument("--max-columns", type=_columns, default=1000, metavar="N",
                        help="heatmap step columns at most (default 1000); a zoom to fewer steps shows each step")
    add_detector_option(parser)
    parser.set_defaults(func=_main)


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..65535, got {text[:30]!r}")
    return int(text)


def _columns(text: str) -> int:
    if not text.strip().isdigit() or not 10 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"must be an integer in 10..100000, got {text[:30]!r}")
    return int(text)


def _main(args: argparse.Namespace) -> int:
    # Ctrl-C (SIGINT) stops the server however it was started: a process started in the background of a script
    # inherits SIGINT ignored, and then Python raises no KeyboardInterrupt
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    views = open_views(Path(args.run_dir), args.max_columns, selected_detectors(args.detectors))
    try:
        try:
            server = Server(views, args.host, args.port)
        except OSError as exc:
            raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
        if server.hosts is None:
            print(f"warning: listening on {args.host}: whoever reaches this address reads the run", file=sys.stderr)
        print(f"serving {args.run_dir} at {server.url} (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        print("stopped", file=sys.stderr, flush=True)
    finally:
        views.source.close()
    return 0


__all__ = ["DEFAULT_PORT", "BadRequest", "Server", "Views", "add_parser", "open_views"]
