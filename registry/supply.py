"""The adapter supply chain on top of the registry: uploads into the adapter store, and retention
(garbage collection of versions no binding has used for a while). docs/DESIGN.md, "Adapter supply chain".

An upload is one operation: the body streams into a temporary object (size-capped), admission runs
on exactly those bytes, the files are stored content-addressed (``sha256/{digest}/``) and the version
is registered with one audit row. A refusal at any step leaves the store and the registry as they were.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import String, cast, or_, select

from loraplex.adapter_store import (
    CONTENT_PREFIX,
    UPLOAD_PREFIX,
    AdapterStore,
    StoreError,
    TooLarge,
    version_keys,
    version_prefix,
)
from loraplex.peft_config import ADAPTER_FILES
from registry.admission import AdmissionError, admit_contents, admit_uri
from registry.errors import Invalid, RegistryError, Unavailable
from registry.lookups import binding_record
from registry.models import AdapterVersion, AuditEntry, Binding
from registry.records import AdapterRecord, BindingRecord
from registry.service import RegistryService

log = logging.getLogger("loraplex.registry.supply")

GC_REASON = "garbage-collected: its files were deleted from the adapter store"
STALE_UPLOAD_S = 3600.0
"""A temporary upload object this old belongs to an upload that died; gc deletes it."""
MAX_RETENTION_S = 100 * 365 * 86400
"""A century: far past any retention anyone means, well inside what a date can subtract."""


class UploadTooLarge(Invalid):
    status = 413
    default_code = "upload_too_large"


class SupplyChain:
    def __init__(self, service: RegistryService, store: AdapterStore | None = None) -> None:
        self.service = service
        self._store = store

    @property
    def store(self) -> AdapterStore:
        if self._store is None:
            try:
                self._store = self.service.adapter_store
            except ValueError as exc:
                raise Unavailable(f"the adapter store is misconfigured: {exc}", code="store_misconfigured") \
                    from None
        return self._store

    # --- upload ----------------------------------------------------------------------------

    async def upload(self, name: str, base_model: str, body: AsyncIterable[bytes], *, config_bytes: int,
                     owner: str | None = None, version: int | None = None,
                     actor: str = "admin") -> AdapterRecord:
        """Store and register the version whose files arrive in ``body``: ``adapter_config.json``
        (its first ``config_bytes`` bytes), then ``adapter_model.safetensors``."""
        settings = self.service.settings
        cap = settings.max_adapter_bytes
        if isinstance(config_bytes, bool) or not isinstance(config_bytes, int) or not 0 < config_bytes <= cap:
            raise Invalid(f"config_bytes must be the size of adapter_config.json (1 to {cap}), got {config_bytes!r}",
                          param="config_bytes")
        base = await self.service.base_model_info(base_model)  # 404 before a byte is stored
        store = self.store
        tmp = f"{UPLOAD_PREFIX}{uuid.uuid4().hex}"
        try:
            try:
                size = await store.put(tmp, _capped(body, cap))
            except TooLarge:
                raise UploadTooLarge(f"the upload is larger than the cap of {cap} bytes "
                                     f"(LORAPLEX_MAX_ADAPTER_BYTES)", param="body") from None
            except StoreError as exc:
                raise Unavailable(f"the adapter store could not take the upload: {exc}",
                                  code="store_unavailable") from None
            if size <= config_bytes:
                raise Invalid(f"the upload is {size} bytes: no room for adapter_model.safetensors after a "
                              f"{config_bytes}-byte adapter_config.json", code="missing_file", param="body")
            try:
                data = await store.read(tmp, cap)
            except StoreError as exc:
                raise Unavailable(f"the adapter store lost the upload: {exc}", code="store_unavailable") from None
        finally:
            await _quietly(store.delete([tmp]))
        contents = {ADAPTER_FILES[0]: data[:config_bytes], ADAPTER_FILES[1]: data[config_bytes:]}
        del data
        try:
            admitted = await asyncio.to_thread(admit_contents, contents, base, settings, uri="upload")
        except AdmissionError as exc:
            log.info("upload of %s refused: %s", name, exc)
            raise Invalid(f"adapter refused: {exc.message}", code=exc.code, param="body") from None
        prefix = version_prefix(admitted.sha256)
        uri = store.uri_for(prefix)
        admitted = dataclasses.replace(admitted, uri=uri)
        keys = version_keys(prefix)
        existed = await self._present(keys)
        if not existed:
            await self._put_version(prefix, contents)

        async def ensure_stored() -> None:
            # Inside the registry write, under the files' lock: a concurrent refused upload of the
            # same bytes may have removed the shared files after this one stored them.
            if not await self._present(keys):
                await self._put_version(prefix, contents)

        try:
            return await self.service.register_adapter(name, uri, base_model, version=version, owner=owner,
                                                       actor=actor, admitted=admitted, in_tx=ensure_stored)
        except RegistryError:
            if not existed:
                await self._drop_if_unused(prefix, admitted.sha256)
            raise

    async def _present(self, keys: list[str]) -> bool:
        try:
            listed = {o.key for o in await self.store.list(keys[0].rsplit("/", 1)[0] + "/")}
        except StoreError as exc:
            raise Unavailable(f"the adapter store is unavailable: {exc}", code="store_unavailable") from None
        return all(k in listed for k in keys)

    async def _put_version(self, prefix: str, contents: dict[str, bytes]) -> None:
        try:
            for name in ADAPTER_FILES:
                await self.store.put(prefix + name, contents[name])
        except StoreError as exc:
            await _quietly(self.store.delete(version_keys(prefix)))
            raise Unavailable(f"the adapter store could not take the upload: {exc}", code="store_unavailable") \
                from None

    async def _drop_if_unused(self, prefix: str, digest: str) -> None:
        """Undo a refused upload's files unless a version records them, deciding and deleting under
        the files' lock so a concurrent registration of the same bytes cannot interleave."""
        try:
            async with self.service.db.write("upload-cleanup") as tx:  # records no change: rolled back
                await tx.serialize(self.store.uri_for(prefix))
                used = (await tx.session.execute(select(AdapterVersion.id).where(
                    AdapterVersion.uri == self.store.uri_for(prefix)).limit(1))).first()
                if used is None:
                    await _quietly(self.store.delete(version_keys(prefix)))
        except RegistryError as exc:
            log.warning("could not clean up the refused upload %s: %s", digest, exc)

    # --- retention -------------------------------------------------------------------------

    async def gc(self, *, apply: bool = False, retention_s: float | None = None, actor: str = "admin") -> dict:
        """Versions no binding (active, previous, canary) has referenced for ``retention_s`` whose
        files are in the store: listed (dry run), or with ``apply`` disabled with an audit row each
        and their files deleted. A version in use is never touched."""
        settings = self.service.settings
        retention = settings.adapter_retention_s if retention_s is None else retention_s
        if isinstance(retention, bool) or not isinstance(retention, int | float) or not 0 <= retention <= MAX_RETENTION_S:
            raise Invalid(f"retention_s must be a number of seconds in [0, {MAX_RETENTION_S}]", param="retention_s")
        store = self.store
        now = datetime.now(UTC)
        cutoff = now - timedelta(seconds=retention)
        async with self.service.db.read() as s:
            plan = await _candidates(s, store, cutoff)
        stale_uploads: list[str] = []
        try:
            stale_uploads = [o.key for o in await store.list(UPLOAD_PREFIX)
                             if (now - o.modified).total_seconds() > STALE_UPLOAD_S]
        except StoreError as exc:
            raise Unavailable(f"the adapter store is unavailable: {exc}", code="store_unavailable") from None
        result: dict[str, Any] = {"apply": apply, "retention_s": retention, "cutoff": cutoff.isoformat(),
                  "versions": [_plan_row(v, last) for v, last in plan], "stale_uploads": stale_uploads,
                  "deleted": []}
        if not apply or (not plan and not stale_uploads):
            return result
        ids = [v.id for v, _ in plan]
        collected: list[AdapterVersion] = []
        if ids:
            async with self.service.db.write(actor) as tx:
                rows = (await tx.session.execute(select(AdapterVersion).where(AdapterVersion.id.in_(ids))
                                                 .with_for_update())).scalars().all()
                in_use = await _in_use(tx.session, ids)
                for row in rows:
                    if row.id in in_use:  # bound since the plan was made: never touched
                        continue
                    before = AdapterRecord.of(row)
                    if row.status_reason != GC_REASON or row.status != "disabled":
                        row.status, row.status_reason = "disabled", GC_REASON
                        await tx.session.flush()
                    tx.audit("adapter.gc", f"adapter:{row.id}", before.audit_json(),
                             AdapterRecord.of(row).audit_json() | {"deleted": version_keys_of(store, row.uri)})
                    collected.append(row)
        async with self.service.db.read() as s:
            keep = await _uris_kept(s, {r.uri for r in collected})
        for row in collected:
            if row.uri in keep:  # another live version records the same content
                continue
            keys = version_keys_of(store, row.uri)
            try:
                await store.delete(keys)
            except StoreError as exc:
                raise Unavailable(f"the versions were retired but the store refused the deletion (run gc "
                                  f"again): {exc}", code="store_unavailable") from None
            result["deleted"].append({"id": row.id, "label": row.label, "uri": row.uri})
        if stale_uploads:
            await _quietly(store.delete(stale_uploads))
        return result


    # --- base-model upgrade ------------------------------------------------------------------

    async def upgrade(self, old: str, new: str, *, dry_run: bool = False, gate: Any = None,
                      actor: str = "admin") -> dict:
        """Carry the active adapter versions of base model ``old`` over to ``new``.

        Each version is admitted again against ``new`` and registered as a new version tied to it
        (its files are unchanged), then put through the activation gate with the eval set it was
        activated with; bindings on ``old`` move, in one audited transaction, only where their
        active version passed (a canary that did not pass is aborted). ``dry_run``: the plan
        (admission against ``new`` and the bindings concerned), nothing changes."""
        svc = self.service
        old_base, new_base = await svc.base_model_info(old), await svc.base_model_info(new)
        if old_base.name == new_base.name:
            raise Invalid("OLD and NEW are the same base model", param="to")
        versions = await svc.list_adapters(base_model=old, status="active")
        carried = {(a.name, a.sha256): a for a in await svc.list_adapters(base_model=new)}
        bindings = [b for b in await svc.list_bindings() if b.base_model == old]
        plan: list[dict[str, Any]] = []
        for v in versions:
            row: dict[str, Any] = {"from": {"id": v.id, "label": v.label}, "to": None,
                                   "bindings": [f"{b.tenant}/{b.alias}" for b in bindings if v.id in _ids(b)]}
            plan.append(row)
            again = carried.get((v.name, v.sha256))
            if again is not None and again.status == "active":  # carried by an earlier run
                row.update(to={"id": again.id, "label": again.label}, passed=True, reason=None)
                continue
            try:
                admitted = await admit_uri(v.uri, new_base, svc.settings, self.store, carried_from=old_base)
            except AdmissionError as exc:
                row.update(passed=False, reason=f"admission against {new}: {exc.message}")
                continue
            if admitted.sha256 != v.sha256:
                row.update(passed=False, reason=f"its files at {v.uri} changed since registration (sha256 "
                                                f"{admitted.sha256} != {v.sha256})")
                continue
            row.update(passed=None if dry_run else False, reason=None)
            if dry_run:
                continue
            fresh = again or await svc.register_adapter(v.name, v.uri, new, owner=v.owner_tenant,
                                                        actor=actor, admitted=admitted)
            row["to"] = {"id": fresh.id, "label": fresh.label}
            evaluation = ((v.verification or {}).get("eval") or {}).get("set")
            if gate is None:
                await svc.activate_adapter(fresh.id, actor=actor, verification={
                    "carried_from": v.label, "gate": "none (no activation gate on this process)"})
                row["passed"] = True
                continue
            base = await svc.base_model_info(new)
            result = await gate({**fresh.to_json(), "base_revision": base.revision},
                                {"eval": evaluation} if evaluation is not None else {})
            verification = dict(result.verification) | {"carried_from": v.label}
            if result.passed:
                await svc.activate_adapter(fresh.id, verification=verification, actor=actor)
                row["passed"] = True
            else:
                await svc.fail_adapter(fresh.id, reason=result.reason, verification=verification, actor=actor)
                row["reason"] = f"activation gate on {new}: {result.reason}"
        moves = {r["from"]["id"]: r["to"]["id"] for r in plan if r.get("passed") and r.get("to")}
        out: dict[str, Any] = {"from": old, "to": new, "dry_run": dry_run, "versions": plan, "bindings": []}
        if dry_run:
            out["bindings"] = [{"binding": f"{b.tenant}/{b.alias}", "moves": None} for b in bindings]
            return out

        async with svc.db.write(actor) as tx:
            rows = (await tx.session.execute(select(Binding).where(Binding.base_model == old)
                                             .order_by(Binding.tenant, Binding.alias).with_for_update())
                    ).scalars().all()
            report: list[dict[str, Any]] = []
            for b in rows:
                target = f"{b.tenant}/{b.alias}"
                if b.active_id not in moves:
                    report.append({"binding": target, "moves": False,
                                   "reason": "its active version did not pass on the new base model"})
                    continue
                before = await binding_record(tx.session, b)
                b.base_model, b.previous_id, b.active_id = new, b.active_id, moves[b.active_id]
                if b.canary_id is not None:
                    if b.canary_id in moves:
                        b.canary_id = moves[b.canary_id]
                    else:
                        b.canary_id, b.canary_percent = None, 0.0
                b.updated_at = datetime.now(UTC)
                await tx.session.flush()
                after = await binding_record(tx.session, b)
                tx.audit("binding.upgrade", f"binding:{target}", before.audit_json(), after.audit_json())
                report.append({"binding": target, "moves": True, "active": after.active.label})
            tx.audit("base_model.upgrade", f"base_model:{old}", {"base_model": old},
                     {"base_model": new, "versions": [{"from": r["from"]["label"], "passed": bool(r.get("passed")),
                                                       "to": (r.get("to") or {}).get("label"),
                                                       "reason": r.get("reason")} for r in plan],
                      "bindings": report})
        out["bindings"] = report
        return out


def _ids(b: BindingRecord) -> set[str]:
    return {r.id for r in (b.active, b.canary) if r is not None}


def version_keys_of(store: AdapterStore, uri: str) -> list[str]:
    key = store.key_of(uri.rstrip("/") + "/")
    return version_keys(key) if key is not None else []


def _plan_row(v: AdapterVersion, last: datetime) -> dict[str, Any]:
    return {"id": v.id, "label": v.label, "status": v.status, "uri": v.uri, "size_bytes": v.size_bytes,
            "last_referenced": last.isoformat()}


async def _in_use(session: Any, ids: list[str]) -> set[str]:
    rows = (await session.execute(select(Binding.active_id, Binding.previous_id, Binding.canary_id).where(
        or_(Binding.active_id.in_(ids), Binding.previous_id.in_(ids), Binding.canary_id.in_(ids)))
        .with_for_update())).all()
    return {i for r in rows for i in r if i}


async def _candidates(session: Any, store: AdapterStore,
                      cutoff: datetime) -> list[tuple[AdapterVersion, datetime]]:
    """Versions in the store, in no binding, whose last reference (creation, or the last binding
    change naming them) is before ``cutoff``."""
    versions = (await session.execute(select(AdapterVersion).order_by(AdapterVersion.name,
                                                                      AdapterVersion.version))).scalars().all()
    in_use = await _in_use(session, [v.id for v in versions]) if versions else set()
    out = []
    for v in versions:
        if v.id in in_use or store.key_of(v.uri.rstrip("/") + "/") is None:
            continue
        if not v.uri.rstrip("/").rsplit("/", 1)[0].endswith(CONTENT_PREFIX.rstrip("/")):
            continue  # only content-addressed versions: other URIs are the training pipeline's
        last = _aware(v.created_at)
        mentions = (await session.execute(select(AuditEntry.at).where(
            AuditEntry.action.like("binding.%"),
            or_(cast(AuditEntry.before, String).contains(v.id), cast(AuditEntry.after, String).contains(v.id)))
            .order_by(AuditEntry.at.desc()).limit(1))).scalar_one_or_none()
        if mentions is not None:
            last = max(last, _aware(mentions))
        if last < cutoff:
            out.append((v, last))
    return out


async def _uris_kept(session: Any, uris: set[str]) -> set[str]:
    if not uris:
        return set()
    rows = await session.execute(select(AdapterVersion.uri).where(
        AdapterVersion.uri.in_(uris), or_(AdapterVersion.status != "disabled",
                                          AdapterVersion.status_reason.is_(None),
                                          AdapterVersion.status_reason != GC_REASON)))
    return {r.uri for r in rows}


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


async def _capped(body: AsyncIterable[bytes], cap: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in body:
        total += len(chunk)
        if total > cap:
            raise TooLarge(f"over {cap} bytes")
        if chunk:
            yield chunk


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except (StoreError, OSError) as exc:
        log.warning("adapter store cleanup failed: %s", exc)
