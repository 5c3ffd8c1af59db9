"""One HTTP client for the tests' plain requests to their servers.

httpx's module functions (``httpx.get``, ``httpx.post``, ``httpx.stream``) make a client for
each call, and with it an SSL context that reads the CA bundle: about 30 ms of CPU a call, which
a poll every quarter second spends on the core the server it waits for starts on (the suite's
profile, 2026-12-08: 45 s of CPU in all). ``HTTP`` keeps no connection between requests, so each
one opens its own and is sent as the module function would send it (the same default timeout of
5 s, no redirects followed), and it keeps no cookie either: one a test server set would be
sent to every other (cookies name no port). It is safe to share between threads."""

from __future__ import annotations

from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

HTTP = httpx.Client(
    limits=httpx.Limits(max_keepalive_connections=0),
    cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),
)
