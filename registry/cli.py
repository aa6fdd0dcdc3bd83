"""``loraplex migrate`` and ``loraplex admin``: schema migrations and registry operations.

``admin`` talks HTTP to the gateway's admin API (``LORAPLEX_ADMIN_URL`` + ``/admin``) with
``LORAPLEX_ADMIN_TOKEN`` or an admin token minted from ``LORAPLEX_JWT_SECRET``; human tables,
or JSON with ``--json``; a refusal prints the reason (and its evidence) and exits 1. Global
options go before or after the subcommand. Heavy modules are imported inside handlers so
``--help`` is fast. Here: the command tree; the handlers are ``registry.admin_commands``, the HTTP
call and the output ``registry.admin_client``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from registry import usage_commands
from registry.admin_client import (
    cli_handler,
    json_object_arg,
    percent_arg,
)
from registry.admin_commands import (
    adapter_activate,
    adapter_disable,
    adapter_enable,
    adapter_fail,
    adapter_list,
    adapter_register,
    adapter_show,
    adapter_upload,
    audit,
    base_model_add,
    base_model_list,
    base_model_upgrade,
    bind,
    binding_delete,
    binding_disable,
    binding_enable,
    binding_list,
    binding_show,
    canary_abort,
    canary_pause,
    canary_promote,
    canary_resume,
    canary_set,
    canary_set_policy,
    canary_start,
    canary_status,
    gc,
    limits_report,
    rollback,
    tenant_cache_scope,
    tenant_create,
    tenant_disable,
    tenant_enable,
    tenant_limits,
    tenant_list,
    tenant_show,
    version,
)

# --- migrate ---------------------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    from loraplex.settings import get_settings
    from registry.migrate import downgrade, upgrade

    url = args.database_url or get_settings().resolved_database_url()
    try:
        if args.down:
            downgrade(url, args.revision or "-1")
        else:
            upgrade(url, args.revision or "head")
    except Exception as exc:
        print(f"error: migration failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    direction = "downgraded" if args.down else "upgraded"
    print(f"registry schema {direction} to {args.revision or ('-1' if args.down else 'head')}")
    return 0




# --- parsers -----------------------------------------------------------------------------------------

def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def show(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2
    return show


def register(subparsers: Any) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    m = subparsers.add_parser(
        "migrate", help="apply the registry schema migrations (alembic upgrade head)", formatter_class=fmt,
        description="Apply the registry schema migrations to LORAPLEX_DATABASE_URL (default: the embedded "
                    "SQLite file under LORAPLEX_HOME).\n\nexamples:\n  loraplex migrate\n"
                    "  loraplex migrate --revision 0001\n  loraplex migrate --down --revision base")
    m.add_argument("--revision", help="target revision (default: head; with --down: one step back)")
    m.add_argument("--down", action="store_true", help="downgrade instead of upgrade")
    m.add_argument("--database-url", help="override LORAPLEX_DATABASE_URL")
    m.set_defaults(handler=_migrate)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON instead of a table (for scripts)")
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help="gateway base URL (default: LORAPLEX_ADMIN_URL or the gateway host/port)")
    common.add_argument("--token", default=argparse.SUPPRESS,
                        help="admin JWT (default: LORAPLEX_ADMIN_TOKEN, else minted from LORAPLEX_JWT_SECRET)")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS,
                        help="HTTP timeout in seconds (default 30; adapter activate: 330, as the gate probes for "
                        "up to 300)")

    admin = subparsers.add_parser(
        "admin", help="operate the registry: tenants, adapters, bindings, canaries, limits, audit",
        parents=[common], formatter_class=fmt,
        description="Operate the registry through the gateway's admin API.\n\n"
                    "typical flow:\n"
                    "  loraplex admin tenant create acme --tokens-per-min 50000\n"
                    "  loraplex admin base-model add --from-model ./SmolLM2-135M-Instruct\n"
                    "  loraplex admin adapter register support-bot support-v1 --base-model SmolLM2-135M-Instruct "
                    "--owner acme\n"
                    "  loraplex admin adapter activate support-bot@1\n"
                    "  loraplex admin bind acme support support-bot@1\n"
                    "  loraplex admin canary start acme support support-bot@2 --percent 10\n"
                    "  loraplex admin canary promote acme support\n"
                    "  loraplex admin rollback acme support\n"
                    "  loraplex admin audit --target 'binding:acme/*'\n\n"
                    "Adapters are named by id (uuid) or NAME@VERSION. --url, --token, --json and --timeout "
                    "go before or after the subcommand. Exit status: 0 ok, 1 refused, 2 usage, 3 admin API "
                    "unreachable.")
    admin.set_defaults(handler=_help_of(admin))
    groups = admin.add_subparsers(dest="admin_command", metavar="COMMAND")

    def leaf(parent: Any, name: str, fn: Callable[[argparse.Namespace], int], help_text: str,
             description: str | None = None) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_text, description=description or help_text, parents=[common],
                              formatter_class=fmt)
        p.set_defaults(handler=cli_handler(fn))
        return p

    def group(name: str, help_text: str) -> Any:
        g = groups.add_parser(name, help=help_text, description=help_text, parents=[common])
        g.set_defaults(handler=_help_of(g))
        return g.add_subparsers(metavar="COMMAND")

    def limit_args(p: argparse.ArgumentParser, defaults: bool) -> None:
        p.add_argument("--requests-per-min", type=int, default=600 if defaults else None,
                       help="requests per minute" + (" (default 600)" if defaults else ""))
        p.add_argument("--tokens-per-min", type=int, default=100_000 if defaults else None,
                       help="prompt + completion tokens per minute" + (" (default 100000)" if defaults else ""))
        p.add_argument("--max-concurrent", type=int, default=16 if defaults else None,
                       help="requests in flight at once" + (" (default 16)" if defaults else ""))
        p.add_argument("--priority", choices=["high", "normal", "low"], default="normal" if defaults else None,
                       help="scheduling class on the workers" + (" (default normal)" if defaults else ""))

    t = group("tenant", "create, list, disable, enable tenants and set their limits and cache scope")
    p = leaf(t, "create", tenant_create, "create a tenant")
    p.add_argument("slug", help="tenant id (a-z, 0-9, '-', '_'); the JWT tenant claim")
    limit_args(p, True)
    p.add_argument("--cache-scope", metavar="NAME", help="a shared prefix-cache scope (see tenant cache-scope; "
                   "default: the tenant's own)")
    p = leaf(t, "list", tenant_list, "list tenants")
    p.add_argument("--status", choices=["active", "disabled"], help="only tenants in this status")
    p = leaf(t, "show", tenant_show, "show one tenant")
    p.add_argument("slug")
    p = leaf(t, "disable", tenant_disable, "disable a tenant: its requests are refused")
    p.add_argument("slug")
    p = leaf(t, "enable", tenant_enable, "enable a tenant again")
    p.add_argument("slug")
    p = leaf(t, "limits", tenant_limits, "change a tenant's limits or priority (only the options given)")
    p.add_argument("slug")
    limit_args(p, False)
    p.add_argument("--response-retention-s", type=int, help="seconds the tenant's stored Responses are kept "
                   "(default: LORAPLEX_RESPONSE_RETENTION_S; at most LORAPLEX_RESPONSE_MAX_RETENTION_S)")

    p = leaf(t, "cache-scope", tenant_cache_scope, "put a tenant in a shared prefix-cache scope, or its own",
             "Put a tenant in a shared prefix-cache scope NAME: its requests then reuse the cached prompt "
             "prefixes (KV blocks) of every tenant in that scope, for the same base model and adapter version. "
             "By default a tenant shares with no one: a shared cache answers faster for prompts another tenant "
             "sent, so one tenant could tell what another asked. Share only among tenants that trust each other "
             "(one company's several tenants). --own puts it back in its own scope.\n\nexamples:\n"
             "  loraplex admin tenant cache-scope acme-eu acme\n  loraplex admin tenant cache-scope acme-eu --own")
    p.add_argument("slug")
    p.add_argument("name", nargs="?", help="the shared scope (1-63 of a-z, 0-9, '_', '.', '-')")
    p.add_argument("--own", action="store_true", help="back to the tenant's own scope (the default)")

    bm = group("base-model", "register and list base models")
    p = leaf(bm, "add", base_model_add, "register a base model",
             "Register a base model. With --from-model the dimensions and the content revision are read "
             "from a local HF directory (config.json + *.safetensors) or a .gguf file; otherwise give them "
             "all as options.")
    p.add_argument("--from-model", metavar="PATH", help="HF model directory or .gguf file to describe")
    p.add_argument("--name", help="registered name (default: derived from the path)")
    p.add_argument("--revision", help="content revision (default: hash of the model files)")
    p.add_argument("--architecture")
    for dim in ("hidden-size", "intermediate-size", "num-layers", "num-heads", "num-kv-heads", "head-dim",
                "vocab-size", "context-length"):
        p.add_argument(f"--{dim}", type=int)
    leaf(bm, "list", base_model_list, "list base models")
    p = leaf(bm, "upgrade", base_model_upgrade, "carry adapter versions and bindings from OLD to NEW",
             "List every active adapter version on base model OLD, re-admit each against NEW, register it as a "
             "new version tied to NEW and run the activation gate on it with the eval set it was activated "
             "with; then move the bindings whose versions pass, in one audited transaction (the others stay "
             "on OLD, with the reason). --dry-run prints the plan and changes nothing. The gate probes each version on a "
             "worker: give a --timeout that covers them all.")
    p.add_argument("old", help="the base model the adapters were trained on")
    p.add_argument("new", help="the new base model (register it first with base-model add)")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")

    ad = group("adapter", "register, list, activate, disable adapter versions")
    p = leaf(ad, "register", adapter_register, "register a new adapter version (admission checks run; "
             "the version starts pending)",
             "Register an adapter version. The artifact must be a PEFT directory (adapter_config.json + "
             "adapter_model.safetensors) under the adapter root; the registry checks shapes against the base "
             "model, rank cap, target modules, NaN/Inf, base revision and pickle files, and refuses with "
             "the reason.")
    p.add_argument("name", help="adapter name (versions are numbered per name)")
    p.add_argument("uri", help="file:// URI or path (absolute, or relative to LORAPLEX_ADAPTER_ROOT) of the "
                   "PEFT directory, as the gateway host sees it")
    p.add_argument("--base-model", required=True, help="base model name the adapter was trained on")
    p.add_argument("--version", type=int, help="version number (default: the next one)")
    p.add_argument("--owner", help="owning tenant (default: shared by all tenants)")
    p.add_argument("--expected-revision", help="refuse unless the registry's base model has this revision")
    p = leaf(ad, "upload", adapter_upload, "upload a PEFT directory into the adapter store and register it",
             "Stream DIR's adapter_config.json and adapter_model.safetensors to the gateway (size-capped by "
             "LORAPLEX_MAX_ADAPTER_BYTES), which runs admission on the uploaded bytes, stores them "
             "content-addressed (sha256) in the adapter store (LORAPLEX_ADAPTER_STORE) and registers the "
             "version as pending, with one audit row. A refusal leaves nothing behind.")
    p.add_argument("dir", help="local PEFT directory")
    p.add_argument("name", help="adapter name (versions are numbered per name)")
    p.add_argument("--base-model", required=True, help="base model name the adapter was trained on")
    p.add_argument("--owner", help="owning tenant (default: shared by all tenants)")
    p.add_argument("--version", type=int, help="version number (default: the next one)")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is no terminal")
    p = leaf(ad, "list", adapter_list, "list adapter versions")
    p.add_argument("--name")
    p.add_argument("--base-model")
    p.add_argument("--owner")
    p.add_argument("--status", choices=["pending", "active", "disabled", "failed"])
    p = leaf(ad, "show", adapter_show, "show one adapter version")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p = leaf(ad, "activate", adapter_activate, "activate an adapter version (it can then be bound)",
             "Activate an adapter version. On a gateway with the activation gate, a worker first probes "
             "the version (its answers must not be empty or one same text for every prompt, must differ "
             "from the base model's; with --eval, the share of answers matching each case's regex must "
             "reach the threshold); a refusal marks it failed and prints the evidence (probe outputs, "
             "failed eval cases). Activating a failed (or disabled) version runs the gate again.")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--eval", type=json_object_arg, metavar="JSON|@FILE",
                   help='evaluation set for the gateway\'s activation gate: {"cases": [{"prompt": ..., '
                        '"expect": REGEX}], "threshold": 0.8}')
    p.add_argument("--verification", type=json_object_arg,
                   help="JSON object of results to record (only where the gateway runs no activation gate)")
    p = leaf(ad, "disable", adapter_disable, "disable an adapter version (refused while bindings use it, "
             "unless --force)",
             "Disable an adapter version. While bindings route to it (as active version or canary) this is "
             "refused and the bindings are named; with --force their canaries on it are aborted and the "
             "bindings active on it disabled (each audited, listed in the answer).")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--reason", help="why (recorded with the version and in the audit log)")
    p.add_argument("--force", action="store_true", help="also disable the bindings that use it")
    p = leaf(ad, "enable", adapter_enable, "re-enable a disabled adapter version that had been active "
             "(bindings disabled with it stay disabled)")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p = leaf(ad, "fail", adapter_fail, "mark a pending adapter version failed")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--reason", required=True)
    p.add_argument("--verification", type=json_object_arg, help="JSON object of probe/eval results")

    p = leaf(groups, "bind", bind, "bind a tenant's alias to an active adapter version (the current one "
             "becomes previous)")
    p.add_argument("tenant")
    p.add_argument("alias", help="the model name the tenant's backend sends")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--on-disabled", choices=["base", "refuse"],
                   help="when the binding is disabled with its adapter version (adapter disable --force): "
                        "answer with the base model or refuse (default refuse); `binding disable` takes "
                        "its own --on-disabled")
    p = leaf(groups, "rollback", rollback, "roll an alias back to its previous version (one step; run "
             "again to roll forward)")
    p.add_argument("tenant")
    p.add_argument("alias")

    c = group("canary", "send a share of an alias's traffic to a new version, then promote or abort")
    p = leaf(c, "start", canary_start, "start a canary")
    p.add_argument("tenant")
    p.add_argument("alias")
    p.add_argument("adapter", help="id or NAME@VERSION (active, same base model)")
    p.add_argument("--percent", type=percent_arg, required=True, help="share of requests, 0 < P <= 100")
    p = leaf(c, "set", canary_set, "change the canary percent (to PERCENT, or --by a signed step)")
    p.add_argument("tenant")
    p.add_argument("alias")
    p.add_argument("percent", type=percent_arg, nargs="?", help="share of requests, 0 < P <= 100")
    p.add_argument("--by", type=percent_arg, help="change the current percent by this much (e.g. +5 or -10); "
                   "a conditional write, retried when another write came in between")
    for name, fn, text in (("promote", canary_promote, "make the canary the active version"),
                           ("abort", canary_abort, "stop the canary"),
                           ("status", canary_status, "the canary policy, the step, the last judgement's numbers"),
                           ("pause", canary_pause, "stop the judge from deciding (the canary keeps its percent)"),
                           ("resume", canary_resume, "let the judge decide again")):
        p = leaf(c, name, fn, text)
        p.add_argument("tenant")
        p.add_argument("alias")
    p = leaf(c, "set-policy", canary_set_policy, "how the judge steps up, promotes or aborts this alias's "
             "canaries (fields not given keep their current or default value)")
    p.add_argument("tenant")
    p.add_argument("alias")
    p.add_argument("--steps", help="comma-separated percents, e.g. 5,10,25,50,100 (default)")
    p.add_argument("--interval", type=float, help="least seconds on a step (default 60)")
    p.add_argument("--min-requests", type=int, help="no judgement on fewer requests per arm (default 50)")
    p.add_argument("--max-failures", type=int, help="failed judgements in a row that abort (default 2)")
    p.add_argument("--check", action="append", metavar="NAME=THRESHOLD[@metadata.KEY]",
                   help="replaces the checks: error_rate, empty_share, length_share, ttft_p99 (ratio above), "
                        "tokens_per_s (ratio below), completion_length (ratio outside [1/t, t]); repeat. "
                        "@metadata.KEY judges the check per value of that key of the requests' metadata, "
                        "e.g. empty_share=2@metadata.topic")
    p.add_argument("--proportion-test", choices=["two-proportion-z", "fisher-exact"])
    p.add_argument("--sample-test", choices=["mann-whitney-u"])
    p.add_argument("--alpha", type=float, help="significance level (default 0.05)")

    bg = group("binding", "list, show, enable, disable and delete bindings")
    p = leaf(bg, "list", binding_list, "list bindings")
    p.add_argument("--tenant")
    for name, fn, text in (("show", binding_show, "show one binding"),
                           ("enable", binding_enable, "enable a binding"),
                           ("disable", binding_disable, "disable a binding"),
                           ("delete", binding_delete, "remove an alias (its requests get 404)")):
        p = leaf(bg, name, fn, text)
        p.add_argument("tenant")
        p.add_argument("alias")
        if name == "enable":
            p.add_argument("--on-disabled", choices=["base", "refuse"],
                           help="what it falls back to if disabled with its adapter version (adapter "
                                "disable --force): base model or refuse")
        if name == "disable":
            p.add_argument("--on-disabled", choices=["base", "refuse"], default="refuse",
                           help="while disabled: answer with the base model or refuse (default refuse; "
                                "applies to this disable only, whatever was chosen before)")

    p = leaf(groups, "gc", gc, "retention: delete versions no binding has used for a while from the store "
             "(dry run unless --apply)",
             "List the adapter versions in the store that no binding (active, previous or canary) has "
             "referenced for the retention period (LORAPLEX_ADAPTER_RETENTION_S); with --apply, retire them "
             "(disabled, one audit row each) and delete their files. A version in use is never touched.")
    p.add_argument("--apply", action="store_true", help="delete (default: only print the plan)")
    p.add_argument("--retention", type=float, metavar="SECONDS", help="override the retention period")
    p = leaf(groups, "audit", audit, "show the audit trail, newest first")
    p.add_argument("--actor")
    p.add_argument("--action", help="e.g. binding.rollback, tenant.limits")
    p.add_argument("--target", help="e.g. tenant:acme, binding:acme/support, or a prefix ending in *")
    p.add_argument("--since-version", type=int, help="only changes after this registry version")
    p.add_argument("--limit", type=int, default=50, help="at most this many entries (1-1000, default 50)")
    leaf(groups, "version", version, "print the registry version")
    usage_commands.register(groups, leaf)

    lim = group("limits", "tune tenants' limits from the usage ledger")
    p = leaf(lim, "report", limits_report, "per tenant: limits, p99 and peak per minute, throttling, suggestions",
             "Per tenant, over the window's minute buckets of the usage ledger: its limits, the p99 and peak per "
             "minute of requests (admitted and refused: the demand), tokens (prompt + completion admitted) and "
             "concurrency, the minutes in which it was throttled and its 429s by reason, and a suggested limit "
             "per dimension with the reason: the p99 (over the minutes with traffic) plus the headroom, rounded "
             "up to two significant figures, where the limit is below 1.1x or above 3x the p99. Each suggestion "
             "is printed with the `tenant limits` command that applies it (audited as any limits change).\n\n"
             "examples:\n  loraplex admin limits report\n  loraplex admin limits report --window 24h --sort "
             "headroom\n  loraplex admin limits report --tenant acme --json")
    p.add_argument("--window", default="7d", help="how far back: e.g. 7d (default), 24h, 90m (1h to 90d; minute "
                   "buckets older than their retention are gone, and the report says so)")
    p.add_argument("--sort", choices=["throttled", "headroom"], default="throttled",
                   help="throttled: most throttled minutes first (default); headroom: least headroom first")
    p.add_argument("--tenant", help="this tenant only")
    p.add_argument("--limit", type=int, help="at most this many tenants (default 100, at most 1000)")
    p.add_argument("--headroom", type=int, metavar="PERCENT",
                   help="percent a suggestion adds over the p99 (10-100, default 25)")
