"""`GET /dashboard`: server-rendered cost pages (overview, one tenant), its login and its CSS.

Pages are Jinja2 templates shipped in the package, charts inline SVG, no script: the
Content-Security-Policy allows only this gateway's own stylesheet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import Receive, Scope, Send

from proxy.asgi.body import ClientGone, read_body
from proxy.errors import (
    AuthenticationFailed,
    BadRequest,
    BodyTooLarge,
    GatewayError,
    PermissionDenied,
)
from proxy.ledger import LedgerError
from proxy.ledger.present import day_start, iso_utc
from proxy.stages.auth import as_header_value
from proxy.web import pagefmt
from proxy.web.dashview import Window, load_overview, load_tenant_page
from proxy.web.session import SECURE_COOKIE_NAME, Sessions, Viewer, caller, cookie_name
from proxy.web.usage import (
    WINDOW_PARAMS,
    check_names,
    ledger_of,
    ledger_unreadable,
    parse_window,
)

if TYPE_CHECKING:
    from proxy.gateway import Gateway

__all__ = ["DashboardPages"]

_HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
_MAX_FORM_BYTES = 4096
_AUTO_HOURS_S = 2 * 86400  # windows up to two days get hour buckets by default


class DashboardPages:
    """The dashboard's endpoints; `route(name)` is the ASGI app for one of them."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions
        self._templates = Environment(
            loader=PackageLoader("proxy.web", "templates"),
            autoescape=select_autoescape(default=True),
        )
        pagefmt.install(self._templates)
        self._css = resources.files("proxy.web").joinpath("static", "dashboard.css").read_bytes()
        self._css_etag = '"' + hashlib.sha256(self._css).hexdigest()[:16] + '"'

    def route(self, name: str) -> _Endpoint:
        handler: _Handler = getattr(self, name)
        return _Endpoint(self, handler)

    async def overview(self, request: Request) -> Response:
        gateway, viewer, now = await self._context(request)
        window = self._window(request, now, default_since="24h")
        ledger = ledger_of(gateway)
        data = await load_overview(ledger, gateway.policy, viewer.tenant, window, now)
        links = _links(request, window, now)
        return self._page("overview.html", viewer, overview=data, links=links)

    async def tenant(self, request: Request) -> Response:
        gateway, viewer, now = await self._context(request)
        name = str(request.path_params["name"])
        viewer.check(name)
        window = self._window(request, now, default_since="24h")
        data = await load_tenant_page(ledger_of(gateway), gateway.policy, name, window, now)
        links = _links(request, window, now, tenant=name)
        return self._page("tenant.html", viewer, page=data, links=links)

    async def login_form(self, request: Request) -> Response:
        return self._page("login.html", None, next=_safe_next(request.query_params.get("next")))

    async def login(self, request: Request) -> Response:
        _same_site_only(request)
        body = await _read_form(request)
        key = (body.get("key") or [""])[0].strip()
        target = _safe_next((body.get("next") or [""])[0])
        gateway: Gateway = request.state.gateway
        try:
            presented = as_header_value(f"Bearer {key}")  # as the API routes read the key
            self._sessions.authenticate(presented, caller(request, "the dashboard login"))
        except AuthenticationFailed:
            return self._page("login.html", None, next=target, failed=True, status=401)
        cookie = self._sessions.issue(key, gateway.clock.wall())
        if cookie is None:  # a runtime key: a cookie could not name it
            return self._page("login.html", None, next=target, runtime_key=True, status=401)
        response = RedirectResponse(target, status_code=303, headers=_HEADERS)
        name = cookie_name(request)
        response.set_cookie(
            name, cookie, max_age=int(self._sessions.ttl_s), path="/",
            secure=name == SECURE_COOKIE_NAME, httponly=True, samesite="strict",
        )  # fmt: skip
        return response

    async def logout(self, request: Request) -> Response:
        _same_site_only(request)
        gateway: Gateway = request.state.gateway
        ended = gateway.services.ended_sessions
        name = cookie_name(request)
        await self._sessions.end(request.cookies.get(name), gateway.clock.wall(), ended)
        response = RedirectResponse("/dashboard/login", status_code=303, headers=_HEADERS)
        response.delete_cookie(
            name, path="/", secure=name == SECURE_COOKIE_NAME, httponly=True, samesite="strict"
        )
        return response

    async def stylesheet(self, request: Request) -> Response:
        headers = {"cache-control": "public, max-age=3600", "etag": self._css_etag}
        if request.headers.get("if-none-match") == self._css_etag:
            return Response(status_code=304, headers=headers)
        return Response(self._css, media_type="text/css", headers=headers)

    async def _context(self, request: Request) -> tuple[Gateway, Viewer, float]:
        gateway: Gateway = request.state.gateway
        now = gateway.clock.wall()
        ended = gateway.services.ended_sessions
        where = caller(request, "a dashboard page")
        viewer = await self._sessions.resolve(
            request.headers, request.cookies, now, ended, where, cookie=cookie_name(request)
        )
        return gateway, viewer, now

    def _window(self, request: Request, now: float, *, default_since: str) -> Window:
        check_names(request.query_params, WINDOW_PARAMS)  # as /api/usage: nothing ignored
        since, until, bucket = parse_window(request.query_params, now, default_since=default_since)
        chosen = bucket or ("hour" if until - since <= _AUTO_HOURS_S else "day")
        return Window(since, until, chosen, now)

    def _page(
        self, template: str, viewer: Viewer | None, status: int = 200, **values: object
    ) -> Response:
        html = self._templates.get_template(template).render(viewer=viewer, **values)
        return HTMLResponse(html, status_code=status, headers=_HEADERS)

    def error_page(self, request: Request, error: GatewayError) -> Response:
        """Missing or expired login: to the form. Anything else: an error page with its status."""
        if isinstance(error, AuthenticationFailed) and "authorization" not in request.headers:
            target = quote(
                _sent_path(request) + ("?" + request.url.query if request.url.query else "")
            )
            return RedirectResponse(f"/dashboard/login?next={target}", 303, headers=_HEADERS)
        page = self._page("error.html", None, status=error.status, error=error)
        page.headers.update(error.headers())
        return page


_Handler = Callable[[Request], Awaitable[Response]]


class _Endpoint:
    """An ASGI app around one page method: gateway errors become pages (or a redirect)."""

    def __init__(self, pages: DashboardPages, handler: _Handler) -> None:
        self._pages = pages
        self._handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await self._handler(request)
        except ClientGone:
            return  # it left before its form came: no one to answer
        except GatewayError as exc:
            response = self._pages.error_page(request, exc)
        except LedgerError as exc:
            response = self._pages.error_page(request, ledger_unreadable(exc))
        await response(scope, receive, send)


def _links(
    request: Request, window: Window, now: float, tenant: str | None = None
) -> dict[str, str]:
    """This view's JSON and CSV twins on /api/usage (same window), and the range presets."""
    exact = {"since": iso_utc(window.start), "until": iso_utc(window.end)}
    if tenant is not None:
        exact["tenant"] = tenant
    api = {"json": "/api/usage?" + urlencode(exact)}
    api["csv"] = api["json"] + "&format=csv"
    if tenant is not None:
        api["series"] = api["json"] + f"&bucket={window.bucket}"
        for group in ("model", "key", "user", "tag"):
            api[f"by_{group}"] = api["json"] + f"&group_by={group}"
    path = _sent_path(request)
    today = path + "?" + urlencode({"since": iso_utc(day_start(now))})
    return api | {"self": path, "today": today}


def _sent_path(request: Request) -> str:
    """The page's path as a link to it must say it: percent-encoded as sent. (Starlette's
    request.url.path is decoded, % and all: a tenant named `50%25 off` was linked as the
    tenant `50% off`.)"""
    raw = request.scope.get("raw_path")
    if isinstance(raw, bytes) and raw.isascii():
        return raw.decode()
    return quote(request.scope["path"])


def _safe_next(target: str | None) -> str:
    """Only dashboard pages: a login never redirects elsewhere (no open redirect)."""
    if target and target.startswith("/dashboard") and "//" not in target and "\\" not in target:
        return target
    return "/dashboard"


def _same_site_only(request: Request) -> None:
    """A form another site's page posted (login CSRF: the victim's browser logged in as the
    attacker's tenant) is refused. Browsers name the sender in Sec-Fetch-Site; one that sends
    no Sec-Fetch-Site still sends the page's Origin with a form's POST, which must then be the
    host the request was sent to (a reverse proxy's X-Forwarded-Host counts: a form cannot set
    it). A request with neither (curl) is no browser's."""
    site = request.headers.get("sec-fetch-site")
    if site is None:
        origin = request.headers.get("origin")
        own = origin is None or urlsplit(origin).netloc in (
            request.headers.get("host"), request.headers.get("x-forwarded-host"),
        )  # fmt: skip
    else:
        own = site in ("same-origin", "none")
    if not own:
        raise PermissionDenied(
            "The dashboard's forms are accepted only from its own pages.", code="cross_site"
        )


async def _read_form(request: Request) -> dict[str, list[str]]:
    """The login form, within `server.body_timeout`: a form trickled a byte at a time was
    waited for without end, by a client that needs no key."""
    gateway: Gateway = request.state.gateway
    timeout_s = gateway.policy.server.body_timeout
    try:
        body = await read_body(request.receive, request.headers, _MAX_FORM_BYTES, timeout_s)
    except BodyTooLarge:
        raise BadRequest("The login form is too large.") from None
    try:
        return parse_qs(body.decode(), max_num_fields=8)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest("The login form could not be read.") from exc
