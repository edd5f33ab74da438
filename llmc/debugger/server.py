"""
llmc/debugger/server.py: the debugger's web server (Python's http.server, no framework).

What it is: a ThreadingHTTPServer bound to 127.0.0.1 that serves the page (static/), Plotly's
plotly.min.js from the installed plotly package (so the page works offline), the trainer's
source files read-only, and a JSON API over a Session (session.py), a --check run
(checkrun.py) and a kernel trace (kerneltrace.py).

Protection, as Jupyter's:
    token   a random token in the printed URL (?token=...); the first page load sets it as a
            SameSite=Strict, HttpOnly cookie; every request needs it (query, X-Debugger-Token
            header or cookie), compared in constant time: 403 without it
    Host    the Host header must name this server (127.0.0.1:PORT, localhost:PORT or the bound
            host): 403 otherwise, so a web page that rebinds its own domain to 127.0.0.1 (DNS
            rebinding) gets nothing
    paths   nothing is opened by a name from a request: static files, plotly.min.js and the
            source files are a fixed table made at start-up; --check-run and --kernel-trace
            files are the ones named on the command line
A bad request gets a 4xx JSON {"error": ...} and one line on stderr (`debugger: 404 GET /x: ...`),
never a traceback; an internal error is a 500 and one line, and the server goes on.

What it is not: a server for anyone but the local user; it never listens on a public address
unless --host says so.

API (GET unless said; every answer JSON):
    /api/state?wait=S          where the step stands (waits up to S s while the trainer runs)
    /api/ops                   the ops of a step, in order, with which have run
    /api/op?op=K               op K's detail: tensors (returned, arguments, locals), parameters
    /api/tile?op=K&tensor=KEY&b=&h=&r0=&r1=&c0=&c1=&reduce=mean|maxabs
                               a (reduced) region of a tensor as a matrix (tensors.tile)
    /api/summary?op=K&tensor=KEY&b=&h=   statistics and histogram of that matrix
    /api/param?name=N&layer=L  a parameter, its gradient and last update (L '-' for none)
    /api/adamw                 the last update's update-to-parameter ratios
    /api/attention?layer=&head=&b=&grad=0|1&r0=&r1=&c0=&c1=   a layer's (T,T) attention tile
    /api/tokens?b=             sequence b's tokens, targets and per-position losses
    /api/check, /api/check/tile?run=&tensor=&layer=&b=&h=&r0=..&what=error|ratio   a --check run
    /api/kernel                the --kernel-trace launch, or why there is none
    POST /api/control          {"action": "op"|"to"|"finish"|"next_step", "op": K}
"""

import hmac
import json
import os
import secrets
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from llmc.debugger import tensors
from llmc.debugger.session import BadRequest, Conflict, NotFound

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
MAX_BODY_BYTES = 4096             # a control request is a few dozen bytes
MAX_INDEX = 1 << 31               # any integer parameter beyond this is refused before use
TOKEN_BYTES = 24


def plotly_js_path():
    """The installed plotly package's plotly.min.js. Raises ImportError without plotly."""
    import plotly
    path = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    if not os.path.isfile(path):
        raise ImportError(f"plotly is installed but has no {path}")
    return path


class HttpError(Exception):
    """An answer other than 200: status and a one-line reason."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status = status


class DebuggerServer(ThreadingHTTPServer):
    """The server: the session, the --check runs, the kernel trace, the token and the file table."""
    daemon_threads = True

    def __init__(self, host, port, session, check_runs, kernel_trace, sources, token=None):
        super().__init__((host, port), Handler)
        self.session, self.check_runs, self.kernel_trace = session, check_runs, kernel_trace
        self.token = token or secrets.token_urlsafe(TOKEN_BYTES)
        self.port = self.server_address[1]
        self.allowed_hosts = {f"{h}:{self.port}" for h in ("127.0.0.1", "localhost", "[::1]", host)}
        self.cookie = f"llmc_debugger_{self.port}"
        self.files = {"/": (os.path.join(STATIC_DIR, "index.html"), STATIC_TYPES[".html"])}
        for name in sorted(os.listdir(STATIC_DIR)):
            self.files[f"/static/{name}"] = (os.path.join(STATIC_DIR, name),
                                             STATIC_TYPES.get(os.path.splitext(name)[1], "text/plain"))
        self.files["/static/plotly.min.js"] = (plotly_js_path(), STATIC_TYPES[".js"])
        self.sources = {f"/source/{os.path.basename(p)}": p for p in sources}   # the trainer's files

    def url(self, host="127.0.0.1"):
        return f"http://{host}:{self.port}/?token={self.token}"

    def handle_error(self, request, client_address):
        """A connection that failed outside a handler (reset, broken pipe): one line."""
        e = sys.exc_info()[1]
        print(f"debugger: connection from {client_address[0]} failed: {type(e).__name__}: {e}", file=sys.stderr)

    def serve_in_thread(self):
        thread = threading.Thread(target=self.serve_forever, name="debugger-server", daemon=True)
        thread.start()
        return thread


class Handler(BaseHTTPRequestHandler):
    server_version = "llmc-debugger"
    protocol_version = "HTTP/1.1"

    # one line per bad request; nothing for good ones
    def log_message(self, format, *args):
        pass

    def log_error(self, format, *args):
        print(f"debugger: {format % args}", file=sys.stderr)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_HEAD(self):
        self._answer_error(HttpError(405, "HEAD is not served"), "HEAD")

    def _handle(self, method):
        try:
            self._check_host()
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query, keep_blank_values=True, max_num_fields=32)
            self._check_token(query)
            if method == "POST":
                if url.path != "/api/control":
                    raise HttpError(405, f"POST is only for /api/control, not {url.path}")
                return self._json(self._control())
            if url.path in self.server.files:
                return self._file(*self.server.files[url.path], set_cookie=url.path == "/")
            if url.path in self.server.sources:
                return self._file(self.server.sources[url.path], "text/plain; charset=utf-8")
            route = ROUTES.get(url.path)
            if route is None:
                raise HttpError(404, f"no such page {url.path!r}")
            args = Query(query)
            if route is route_state:                   # a long poll: must not hold the views back
                return self._json(route(self.server, args))
            with self.server.session.gate.reading():   # the trainer stays where it is meanwhile
                result = route(self.server, args)
            return self._json(result)
        except HttpError as e:
            self._answer_error(e, method)
        except NotFound as e:
            self._answer_error(HttpError(404, str(e)), method)
        except (BadRequest, ValueError) as e:
            self._answer_error(HttpError(400, str(e)), method)
        except Conflict as e:
            self._answer_error(HttpError(409, str(e)), method)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:      # noqa: BLE001: a bug here is a 500 and one line, never a dead server
            self._answer_error(HttpError(500, f"internal error: {type(e).__name__}: {e}"), method)

    def _check_host(self):
        host = self.headers.get("Host", "")
        if host not in self.server.allowed_hosts:
            raise HttpError(403, f"Host {host[:80]!r} is not this server")

    def _check_token(self, query):
        given = query.get("token", [""])[0] or self.headers.get("X-Debugger-Token", "")
        if not given:
            for part in self.headers.get("Cookie", "").split(";"):
                name, _, value = part.strip().partition("=")
                if name == self.server.cookie:
                    given = value
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self.server.token.encode()):
            raise HttpError(403, "missing or wrong token (use the URL the debugger printed)")

    def _control(self):
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            raise HttpError(413 if length.isdigit() else 411, "a control is a small JSON body")
        body = self.rfile.read(int(length))
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise HttpError(400, "the body is not JSON") from None
        if not isinstance(data, dict):
            raise HttpError(400, "the body must be a JSON object")
        self.server.session.control(data.get("action"), data.get("op"))
        return self.server.session.state_json()

    def _file(self, path, content_type, set_cookie=False):
        with open(path, "rb") as f:
            body = f.read()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        if set_cookie:
            self.send_header("Set-Cookie", f"{self.server.cookie}={self.server.token}; Path=/; HttpOnly; "
                                           f"SameSite=Strict")
            self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj, status=200):
        body = json.dumps(obj, allow_nan=False, default=_json_default).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _answer_error(self, e, method):
        path = self.path if len(self.path) <= 120 else self.path[:117] + "..."
        print(f"debugger: {e.status} {method} {path}: {e}", file=sys.stderr)
        try:
            self._json({"error": str(e)}, e.status)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _json_default(o):
    """NumPy scalars in a JSON answer."""
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON")


class Query:
    """A request's query parameters, each read with a type and a range: ValueError (a 400) for a
    missing, malformed or out-of-range value."""

    def __init__(self, query):
        self.query = query

    def str(self, name, default=None, choices=None):
        values = self.query.get(name)
        if not values:
            if default is None:
                raise ValueError(f"parameter {name!r} is missing")
            return default
        value = values[0]
        if choices is not None and value not in choices:
            raise ValueError(f"{name}={value[:40]!r}: expected one of {', '.join(choices)}")
        if len(value) > 200:
            raise ValueError(f"{name} is too long")
        return value

    def int(self, name, default=None, lo=0, hi=MAX_INDEX):
        text = self.str(name, None if default is None else str(default))
        if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 12:
            raise ValueError(f"{name}={text[:40]!r} is not a (small) integer")
        value = int(text)
        if not lo <= value <= hi:
            raise ValueError(f"{name}={value} out of range [{lo}, {hi}]")
        return value


# ----------------------------------------------------------------------------
# the routes: (server, Query) -> JSON-able

def route_state(server, q):
    wait = q.int("wait", 0, 0, 30)
    return server.session.wait_state(wait) if wait else server.session.state_json()


def route_ops(server, q):
    return {"ops": server.session.ops_json()}


def route_op(server, q):
    s = server.session
    s.readable()
    return s.op_json(q.int("op"))


def _matrix(server, q):
    s = server.session
    s.readable()
    x = s.tensor(q.int("op", 0), q.str("tensor"))
    return s.matrix(x, q.int("b", 0), q.int("h", 0))


def route_tile(server, q):
    m, axes = _matrix(server, q)
    out = tensors.tile(m, q.int("r0", 0), q.int("r1", MAX_INDEX), q.int("c0", 0), q.int("c1", MAX_INDEX),
                       q.str("reduce", "mean", ("mean", "maxabs")))
    return {**out, "rows": m.shape[0], "cols": m.shape[1], "axes": axes}


def route_summary(server, q):
    m, axes = _matrix(server, q)
    return {"stats": tensors.clean(tensors.summary(m)), "histogram": tensors.histogram(m),
            "rows": m.shape[0], "cols": m.shape[1], "axes": axes}


def route_param(server, q):
    s = server.session
    s.readable()
    return s.parameter_json(q.str("name"), q.str("layer", "-"))


def route_adamw(server, q):
    s = server.session
    s.readable()
    return s.adamw_json()


def route_attention(server, q):
    s = server.session
    s.readable()
    cfg = s.model.config
    layer = q.int("layer", 0, 0, cfg.num_layers - 1)
    x, source, index = s.attention_source(layer, bool(q.int("grad", 0, 0, 1)))
    m, axes = s.matrix(x, q.int("b", 0), q.int("head", 0))
    out = tensors.tile(m, q.int("r0", 0), q.int("r1", MAX_INDEX), q.int("c0", 0), q.int("c1", MAX_INDEX))
    return {**out, "rows": m.shape[0], "cols": m.shape[1], "source": source, "op": index,
            "stats": tensors.clean(tensors.summary(m))}


def route_tokens(server, q):
    s = server.session
    s.readable()
    return s.tokens_json(q.int("b", 0))


def route_check(server, q):
    return {"runs": [run.table_json() for run in server.check_runs]}


def route_check_tile(server, q):
    runs = server.check_runs
    i = q.int("run", 0)
    if i >= len(runs):
        raise NotFound(f"no --check run {i} (there are {len(runs)})")
    return runs[i].tile_json(q.str("tensor"), q.int("b", 0), q.int("h", 0), q.str("what", "error", ("error", "ratio")),
                             q.int("r0", 0), q.int("r1", MAX_INDEX), q.int("c0", 0), q.int("c1", MAX_INDEX),
                             q.int("layer", 0))


def route_kernel(server, q):
    return server.kernel_trace.as_json()


ROUTES = {"/api/state": route_state, "/api/ops": route_ops, "/api/op": route_op, "/api/tile": route_tile,
          "/api/summary": route_summary, "/api/param": route_param, "/api/adamw": route_adamw,
          "/api/attention": route_attention, "/api/tokens": route_tokens, "/api/check": route_check,
          "/api/check/tile": route_check_tile, "/api/kernel": route_kernel}
