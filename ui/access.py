"""Who ``finetuner ui`` answers (issue 66): the account that started it, or whoever has its password.

The UI is a server: on a shared machine every local account can reach 127.0.0.1. :class:`Access` is
wrapped around the whole served app (page, API, uploads, file routes, streams, websockets) by
:class:`GuardedApp`, outside gradio's own middleware, so nothing reaches gradio before it decides:

- **No password** (the default): on Linux the TCP connection's other end is looked up in
  ``/proc/net/tcp`` and ``/proc/net/tcp6`` (the socket whose local address is the client's and whose
  remote address is the server's) and its owner's uid must be this process's; a request from another
  account is refused with 403. Where the peer cannot be looked up (not Linux, a client on another
  machine or in another network namespace) the request must carry the launch's secret token: the
  address ``finetuner ui`` prints holds it (``?token=...``), the first visit turns it into an HttpOnly
  cookie and drops it from the address. The token is made in this process, never put in argv or the
  environment.
- **A password** (``--auth-file``, ``FINETUNER_UI_AUTH``): gradio's login, with wrong passwords
  rate-limited per client (:class:`LoginLimiter`: after :data:`FREE_TRIES` failures a client is locked
  out, longer after each further failure; attempts while locked out are refused with 429 and never
  checked), and a client that has not logged in gets only the login page, scrubbed of gradio's API
  description (which names server paths and uploaded files), and the files that draw it.

uvicorn's proxy-header rewriting is turned off while the server starts (:func:`no_forwarded_headers`):
a client on 127.0.0.1 could otherwise name another connection's address in ``X-Forwarded-For``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import math
import os
import re
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from gradio.routes import App

#: wrong passwords a client may try before it is locked out
FREE_TRIES = 5
#: the first lockout (seconds); each further wrong password doubles it, up to :data:`LOCKOUT_CAP_S`
LOCKOUT_S = 10.0
LOCKOUT_CAP_S = 3600.0
#: the query parameter and cookie (``finetuner-ui-PORT``) that carry the launch's token
TOKEN_PARAM = "token"
#: what a client that has not logged in may fetch under a password: the login page and what draws it
_OPEN_PATHS = frozenset({"/", "/login", "/login/", "/favicon.ico", "/theme.css", "/robots.txt", "/manifest.json",
                         "/gradio_api/theme.css", "/gradio_api/startup-events", "/gradio_api/login_check",
                         "/gradio_api/login_check/"})
_OPEN_PREFIXES = ("/assets/", "/static/", "/svelte/", "/gradio_api/static/")
#: the login page's API description, replaced by an empty one for a client that has not logged in
_API_INFO = re.compile(rb"window\.gradio_api_info = .*?;</script>", re.S)
_NO_API_INFO = b'window.gradio_api_info = {"named_endpoints": {}, "unnamed_endpoints": {}};</script>'
#: TCP states whose socket is not a live connection's end: TIME_WAIT, CLOSE, LISTEN
_DEAD_STATES = {"06", "07", "0A"}


# --------------------------------------------------------------------------- the peer's account
def uid_check_possible(proc_net: Path = Path("/proc/net")) -> bool:
    """Whether this machine tells whose a loopback connection is (Linux, ``/proc/net/tcp`` readable)."""
    return sys.platform.startswith("linux") and os.access(proc_net / "tcp", os.R_OK)


def _proc_hex(ip: str) -> set[str]:
    """``ip`` as ``/proc/net/tcp`` (IPv4) and ``tcp6`` print it: each 32-bit word in host byte order, in hex;
    an IPv4 address also as its IPv4-mapped IPv6 form (a dual-stack socket's), and the other way round."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    forms = {addr}
    if addr.version == 6 and addr.ipv4_mapped is not None:
        forms.add(addr.ipv4_mapped)
    if addr.version == 4:
        forms.add(ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + addr.packed))
    out = set()
    for a in forms:
        words = [a.packed[i:i + 4] for i in range(0, len(a.packed), 4)]
        out.add("".join((w[::-1] if sys.byteorder == "little" else w).hex().upper() for w in words))
    return out


def peer_uid(client: tuple[str, int] | None, server: tuple[str, int] | None,
             proc_net: Path = Path("/proc/net")) -> int | None:
    """The uid owning the other end of the TCP connection from ``client`` to ``server`` (both on this
    machine), from ``/proc/net/tcp`` and ``tcp6``; None where it is not found (a client elsewhere, not Linux)."""
    if not client or not server or not client[1] or not server[1]:
        return None
    try:
        local = {f"{h}:{client[1]:04X}" for h in _proc_hex(client[0])}
        remote = {f"{h}:{server[1]:04X}" for h in _proc_hex(server[0])}
    except ValueError:  # not an IP address (a unix socket's path, a name)
        return None
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 7 and f[1] in local and f[2] in remote and f[3] not in _DEAD_STATES:
                return int(f[7])
    return None


# --------------------------------------------------------------------------- wrong passwords
class LoginLimiter:
    """Wrong passwords counted per client: :data:`FREE_TRIES` are checked, then the client is locked out for
    :data:`LOCKOUT_S`, doubled after each further wrong password (up to :data:`LOCKOUT_CAP_S`); a right one
    clears its count. ``clock``: seconds, monotonic (tests give their own). At most ``max_clients`` are kept
    (the longest-quiet forgotten first)."""

    def __init__(self, free: int = FREE_TRIES, lockout_s: float = LOCKOUT_S, cap_s: float = LOCKOUT_CAP_S,
                 clock: Callable[[], float] = time.monotonic, max_clients: int = 10_000):
        self.free, self.lockout_s, self.cap_s, self.clock, self.max_clients = free, lockout_s, cap_s, clock, max_clients
        self._failures: OrderedDict[object, tuple[int, float]] = OrderedDict()  # key → (wrong passwords, locked until)
        self.refused = 0  # attempts refused unchecked, for the report and the tests

    def wait_s(self, key: object) -> float:
        """Seconds until ``key`` may try again (0: now)."""
        _, until = self._failures.get(key, (0, 0.0))
        return max(0.0, until - self.clock())

    def failed(self, key: object) -> None:
        count = self._failures.pop(key, (0, 0.0))[0] + 1
        until = 0.0
        if count >= self.free:
            until = self.clock() + min(self.cap_s, self.lockout_s * 2 ** min(count - self.free, 32))
        self._failures[key] = (count, until)
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)

    def succeeded(self, key: object) -> None:
        self._failures.pop(key, None)


def client_key(client: tuple[str, int] | None, uid: int | None) -> object:
    """Whose wrong passwords these are: the local account when known (another account's cannot lock the
    owner out), else the address, an IPv6 one by its /64 (one machine holds many of those)."""
    if uid is not None:
        return ("uid", uid)
    host = client[0] if client else ""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return ("host", host)
    if addr.version == 6 and addr.ipv4_mapped is None:
        return ("net", str(ipaddress.ip_network(f"{addr}/64", strict=False)))
    return ("ip", str(addr.ipv4_mapped or addr))


# --------------------------------------------------------------------------- the guard
def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


def _cookies(scope) -> dict[str, str]:
    from starlette.requests import cookie_parser

    return cookie_parser(_headers(scope).get(b"cookie", b"").decode("latin-1"))


async def _respond(send, status: int, text: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Access:
    """What ``finetuner ui`` lets through (the module's docstring says how). ``password``: gradio's login is on
    (``launch(auth=...)``); ``proc_net``: where the TCP tables are read (a folder without them: the uid check
    is impossible, as off Linux); ``limiter``: the wrong-password counts (:class:`LoginLimiter`)."""

    def __init__(self, password: bool = False, proc_net: Path = Path("/proc/net"), limiter: LoginLimiter | None = None):
        self.password = password
        self.proc_net = Path(proc_net)
        self.owner = os.geteuid() if hasattr(os, "geteuid") else None
        self.uid_check = self.owner is not None and uid_check_possible(self.proc_net)
        self.token = secrets.token_urlsafe(32)
        self.limiter = limiter or LoginLimiter()
        self.port = 0
        self._login_lock: asyncio.Lock | None = None

    @property
    def cookie(self) -> str:
        return f"finetuner-ui-{self.port}"

    def address(self, host: str, port: int) -> str:
        """The line ``finetuner ui`` prints: the address to open and which protection is on."""
        from ui.paths import LOOPBACK

        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
        url = f"http://{shown}:{port}"
        if self.password:
            why = (f"password required; {self.limiter.free} wrong passwords lock a client out, longer each time")
        elif self.uid_check and host in LOOPBACK:
            why = "only your account: other users of this machine are refused"
        elif self.uid_check:
            url += f"/?{TOKEN_PARAM}={self.token}"
            why = ("your account, and a browser elsewhere given this address with its token; "
                   "other users of this machine are refused")
        else:
            url += f"/?{TOKEN_PARAM}={self.token}"
            why = "only with this address's token: this system cannot tell whose a connection is"
        return f"finetuner UI on {url} ({why}; Ctrl-C to quit)"

    def wrap(self, inner, app: App):
        async def guarded(scope, receive, send):
            if scope["type"] not in ("http", "websocket"):
                return await inner(scope, receive, send)
            return await self.serve(inner, app, scope, receive, send)

        return guarded

    async def _refuse(self, scope, send, status: int, text: str, headers=None) -> None:
        if scope["type"] == "websocket":  # closed before it is accepted: uvicorn answers the handshake with 403
            await send({"type": "websocket.close", "code": 1008})
        else:
            await _respond(send, status, text, headers)

    def peer(self, scope) -> int | None:
        """The uid of the account whose socket sent this request; None where that cannot be told."""
        return peer_uid(scope.get("client"), scope.get("server"), self.proc_net) if self.uid_check else None

    async def serve(self, inner, app: App, scope, receive, send) -> None:
        if self.password:
            return await self._serve_password(inner, app, scope, receive, send)
        uid = self.peer(scope)
        if uid is not None:
            if uid == self.owner:
                return await inner(scope, receive, send)
            return await self._refuse(scope, send, 403, "This finetuner UI serves only the account that started it.")
        return await self._serve_token(inner, scope, receive, send)

    async def _serve_token(self, inner, scope, receive, send) -> None:
        path = scope.get("path", "")
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = dict(query).get(TOKEN_PARAM)
        if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
            if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD"):
                rest = urlencode([(k, v) for k, v in query if k != TOKEN_PARAM])
                cookie = f"{self.cookie}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode()
                where = (path + (f"?{rest}" if rest else "")).encode()
                return await _respond(send, 303, "Opened: the token is kept as a cookie.",
                                      [(b"location", where), (b"set-cookie", cookie)])
            return await inner(scope, receive, send)
        held = _cookies(scope).get(self.cookie, "")
        if held and hmac.compare_digest(held.encode(), self.token.encode()):
            return await inner(scope, receive, send)
        if scope["type"] == "http" and scope.get("method") == "GET" and path == "/gradio_api/startup-events":
            return await inner(scope, receive, send)  # gradio's own check that it started (it runs nothing twice)
        # 401, not 403: gradio's own start-up check of its address takes 401 as "serving"
        await self._refuse(scope, send, 401, "Open the address finetuner ui printed, with its ?token=...")

    def _logged_in(self, app: App, scope) -> bool:
        cookies = _cookies(scope)
        token = cookies.get(f"access-token-{app.cookie_id}") or cookies.get(f"access-token-unsecure-{app.cookie_id}")
        return bool(token) and token in app.tokens

    async def _serve_password(self, inner, app: App, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path in ("/login", "/login/") and scope.get("method") == "POST":
            return await self._login(inner, scope, receive, send, client_key(scope.get("client"), self.peer(scope)))
        if self._logged_in(app, scope):
            return await inner(scope, receive, send)
        if not (path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES)) or scope["type"] != "http":
            return await self._refuse(scope, send, 401, "Not logged in: open the page and give the password.")
        if path != "/":
            return await inner(scope, receive, send)
        return await self._login_page(inner, scope, receive, send)

    async def _login_page(self, inner, scope, receive, send) -> None:
        """The page as gradio serves it to a client that has not logged in, without its API description."""
        scope = dict(scope, headers=[(k, v) for k, v in scope.get("headers", []) if k.lower() != b"accept-encoding"])
        start: dict = {}
        chunks: list[bytes] = []

        async def keep(message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await inner(scope, receive, keep)
        body = b"".join(chunks)
        if b"gradio_api_info" in body:
            body, n = _API_INFO.subn(_NO_API_INFO, body)
            if n != 1:  # gradio changed how it writes the page: refuse rather than show what it holds
                return await _respond(send, 500, "The login page could not be served without the app's description.")
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        if scope.get("method") != "HEAD":
            headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 500), "headers": headers})
        await send({"type": "http.response.body", "body": body if scope.get("method") != "HEAD" else b""})

    async def _login(self, inner, scope, receive, send, key: object) -> None:
        """One login attempt: refused unchecked while ``key`` is locked out; checked one at a time (so that
        attempts sent at once cannot all be checked before the first failure counts)."""
        messages, size = [], 0
        while True:  # the form, read before the check (a client sending it slowly holds no lock)
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body") or size > 65536:
                break
        if size > 65536:
            return await _respond(send, 413, "A login form is a user name and a password.")
        if self._login_lock is None:
            self._login_lock = asyncio.Lock()
        async with self._login_lock:
            wait = self.limiter.wait_s(key)
            if wait > 0:
                self.limiter.refused += 1
                return await _respond(
                    send, 429, f"Too many wrong passwords: try again in {math.ceil(wait)} s.",
                    [(b"retry-after", str(math.ceil(wait)).encode())])
            status: list[int] = []
            replay = iter(messages)

            async def replayed():
                return next(replay, {"type": "http.disconnect"})

            async def seen(message) -> None:
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                await send(message)

            await inner(scope, replayed, seen)
            if status and status[0] == 200:
                self.limiter.succeeded(key)
            elif status and status[0] in (400, 401):
                self.limiter.failed(key)


class GuardedApp(App):
    """gradio's app with :class:`Access` outside all of its middleware (given to ``Blocks.launch`` as its app)."""

    def __init__(self, access: Access, **kwargs):
        from gradio.routes import ORJSONResponse

        self.access = access
        kwargs.setdefault("default_response_class", ORJSONResponse)
        super().__init__(**kwargs)

    def build_middleware_stack(self):
        return self.access.wrap(super().build_middleware_stack(), self)


@contextlib.contextmanager
def no_forwarded_headers() -> Iterator[None]:
    """While the server starts: uvicorn trusts no ``X-Forwarded-For`` (by default it believes one from
    127.0.0.1, which would let a local client name another connection's address as its own)."""
    kept = os.environ.get("FORWARDED_ALLOW_IPS")
    os.environ["FORWARDED_ALLOW_IPS"] = ""
    try:
        yield
    finally:
        if kept is None:
            os.environ.pop("FORWARDED_ALLOW_IPS", None)
        else:
            os.environ["FORWARDED_ALLOW_IPS"] = kept
