"""The web console: the one place an operator sees and changes the fleet, served by the admin API.

``GET /admin/console`` is a page with no data in it; its script (``static/console.js``, no
build step, no third-party code) asks for an admin-scope JWT once, keeps it in the tab's
session storage and sends it as ``Authorization: Bearer`` on every request. Pages are HTML
fragments rendered here (``GET /admin/console/view/{page}``, same token and scope checks as
the admin API); every write the console makes is a call of the admin API's own JSON routes
(the ones ``loraplex admin`` uses), behind a confirm step that shows the row before and after
(``view/confirm``; it lists the calls it makes, in order: a canary with a policy is the policy's
``PUT`` then the canary's ``POST``), conditional on the row version shown (``If-Match``),
audited with the token's subject as the actor. How values are worded (audit diffs, the canary
judge's checks, adapters as ``name@version``) is ``present``.

CSRF-safe by construction: nothing is authorized by a cookie, so a page elsewhere cannot make
the browser send an authorized request. Content-Security-Policy allows scripts, styles and
fetches from this origin only, and no framing.
"""

from __future__ import annotations

from registry.console.views import ConsoleSources, console_routes

__all__ = ["ConsoleSources", "console_routes"]
