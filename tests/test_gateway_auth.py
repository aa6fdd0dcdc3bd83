"""Gateway authentication: JWT checks, tenant checks, the verification cache."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint, mint_admin
from tests.stub_worker import MutableSnapshots, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client

TENANTS = {
    "acme": {"bindings": {"support": {"active": ("sup", 1)}}},
    "globex": {"status": "disabled", "bindings": {}},
}
CHAT = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _settings(**kw) -> Settings:
    return Settings(worker_urls=("http://worker",), **kw)


def _app(settings: Settings, snapshots: MutableSnapshots | None = None):
    snaps = snapshots or MutableSnapshots(make_snapshot(TENANTS))
    client = worker_client(mock_worker_transport())
    return create_app(settings, snapshots=snaps, limiter=LocalLimiter(), residency=MemoryResidency(),
                      http_client=client, mount_admin=False)


async def _post(app, token: str | None, body=CHAT, *, raw_header: str | None = None) -> httpx.Response:
    headers = {}
    if raw_header is not None:
        headers["authorization"] = raw_header
    elif token is not None:
        headers["authorization"] = f"Bearer {token}"
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        return await c.post("/v1/chat/completions", json=body, headers=headers)


def _claims(s: Settings, **over) -> dict:
    now = int(time.time())
    c = {"sub": "u", "iss": s.jwt_issuer, "aud": s.jwt_audience, "iat": now, "exp": now + 600,
         s.jwt_tenant_claim: "acme"}
    c.update(over)
    return {k: v for k, v in c.items() if v is not None}


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "authentication_error"
    assert "Traceback" not in r.text


async def test_valid_token_is_served():
    s = _settings()
    r = await _post(_app(s), mint(s, "u", tenant="acme"))
    assert r.status_code == 200, r.text
    assert r.headers["x-loraplex-adapter"] == "sup@1"


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer", "Bearer   ", "Token x.y.z"])
async def test_missing_or_malformed_header(header):
    s = _settings()
    r = await _post(_app(s), None, raw_header=header)
    _assert_401(r)


async def test_expired_forged_none_and_claims():
    s = _settings(jwt_leeway_s=1.0)
    app = _app(s)
    cases = {
        "expired": jwt.encode(_claims(s, exp=int(time.time()) - 60), s.jwt_secret, algorithm="HS256"),
        "forged": jwt.encode(_claims(s), "some-other-secret-of-sufficient-len", algorithm="HS256"),
        "wrong_issuer": jwt.encode(_claims(s, iss="evil"), s.jwt_secret, algorithm="HS256"),
        "wrong_audience": jwt.encode(_claims(s, aud="other"), s.jwt_secret, algorithm="HS256"),
        "no_exp": jwt.encode(_claims(s, exp=None), s.jwt_secret, algorithm="HS256"),
        "garbage": "not.a.jwt",
    }
    header = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').rstrip(b"=").decode()
    payload = base64.urlsafe_b64encode(json.dumps(_claims(s)).encode()).rstrip(b"=").decode()
    cases["alg_none"] = f"{header}.{payload}."
    cases["alg_none_sig"] = f"{header}.{payload}.c2ln"
    for name, token in cases.items():
        r = await _post(app, token)
        assert r.status_code == 401, (name, r.text)


def _rsa_pem(tmp_path):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    path = tmp_path / "pub.pem"
    path.write_bytes(pub)
    return key, pub, str(path)


async def test_rs256_public_key_and_hs_rs_confusion(tmp_path):
    key, pub, path = _rsa_pem(tmp_path)
    s = _settings(jwt_algorithms=("RS256", "HS256"), jwt_public_key_file=path)
    app = _app(s)
    good = jwt.encode(_claims(s), key, algorithm="RS256")
    assert (await _post(app, good)).status_code == 200
    # HS/RS confusion: an HS256 token whose HMAC key is the public key text.
    import hashlib
    import hmac

    h = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').rstrip(b"=")
    p = base64.urlsafe_b64encode(json.dumps(_claims(s)).encode()).rstrip(b"=")
    sig = base64.urlsafe_b64encode(hmac.new(pub, h + b"." + p, hashlib.sha256).digest()).rstrip(b"=")
    _assert_401(await _post(app, (h + b"." + p + b"." + sig).decode()))
    # RS256 only: HS256 tokens are refused even with the right secret.
    s2 = _settings(jwt_algorithms=("RS256",), jwt_public_key_file=path)
    _assert_401(await _post(_app(s2), mint(s2, "u", tenant="acme")))
    # RS256 signed by another key.
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _assert_401(await _post(app, jwt.encode(_claims(s), other, algorithm="RS256")))


async def test_es256_from_jwks_file(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": "k1", "alg": "ES256", "use": "sig"})
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [jwk]}))
    s = _settings(jwt_algorithms=("ES256",), jwt_jwks_file=str(path))
    app = _app(s)
    good = jwt.encode(_claims(s), key, algorithm="ES256", headers={"kid": "k1"})
    assert (await _post(app, good)).status_code == 200
    _assert_401(await _post(app, jwt.encode(_claims(s), key, algorithm="ES256", headers={"kid": "nope"})))


async def test_tenant_claim_is_configurable():
    s = _settings(jwt_tenant_claim="org")
    token = jwt.encode(_claims(s, org="acme", tenant=None), s.jwt_secret, algorithm="HS256")
    assert (await _post(_app(s), token)).status_code == 200


async def test_unknown_disabled_and_tenantless_tokens_are_refused():
    s = _settings()
    app = _app(s)
    _assert_401(await _post(app, mint(s, "u", tenant="nobody")))
    r = await _post(app, mint(s, "u", tenant="globex"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled"
    r = await _post(app, mint_admin(s))
    assert r.status_code == 403


async def test_cache_honours_expiry_and_snapshot_changes():
    s = _settings(jwt_leeway_s=0.0)
    snaps = MutableSnapshots(make_snapshot(TENANTS))
    app = _app(s, snaps)
    short = mint(s, "u", tenant="acme", ttl_s=2)  # exp is whole seconds: 1-2 s left
    assert (await _post(app, short)).status_code == 200
    exp = jwt.decode(short, options={"verify_signature": False})["exp"]
    await asyncio.sleep(max(0.0, exp - time.time()) + 0.2)
    _assert_401(await _post(app, short))
    # A cached token of a tenant that gets disabled is refused at once.
    token = mint(s, "u", tenant="acme")
    assert (await _post(app, token)).status_code == 200
    snaps.current = make_snapshot({"acme": {"status": "disabled", "bindings": {}}}, version=2)
    assert (await _post(app, token)).status_code == 403


async def test_jwks_key_is_chosen_by_algorithm_family(tmp_path):
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    keys = [json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key())),
            json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key())),
            {"kty": "oct", "k": base64.urlsafe_b64encode(b"shared-secret-in-a-public-file!!").decode(),
             "kid": "oct"}]
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": keys}))
    s = _settings(jwt_algorithms=("RS256", "ES256"), jwt_jwks_file=str(path))
    app = _app(s)
    # No kid: the EC key serves ES256 tokens even though an RSA key comes first.
    assert (await _post(app, jwt.encode(_claims(s), ec_key, algorithm="ES256"))).status_code == 200
    assert (await _post(app, jwt.encode(_claims(s), rsa_key, algorithm="RS256"))).status_code == 200
    # A symmetric key in the JWKS is never used, whatever the kid says.
    forged = jwt.encode(_claims(s), b"shared-secret-in-a-public-file!!", algorithm="HS256", headers={"kid": "oct"})
    _assert_401(await _post(app, forged))
    h = base64.urlsafe_b64encode(b'{"alg":"RS256","kid":"oct"}').rstrip(b"=")
    _assert_401(await _post(app, forged.split(".", 1)[0].replace(forged.split(".")[0], h.decode())
                            + "." + forged.split(".", 1)[1]))


async def test_a_garbage_token_gets_a_401_that_says_only_that_it_is_invalid():
    """Whatever the decoder said of it (segments, padding, JSON) is not the caller's business."""
    s = _settings()
    app = _app(s)
    valid = mint(s, "u", tenant="acme")
    head, payload, _ = valid.split(".")
    cases = {"one segment": "garbage", "three segments": "a.b.c", "not base64": "!!!.???.***",
             "payload not JSON, signed": jwt.api_jws.encode(b"[1,", s.jwt_secret, algorithm="HS256"),
             "signature padding": f"{head}.{payload}.x"}
    for name, token in cases.items():
        r = await _post(app, token)
        _assert_401(r)
        assert r.json()["error"]["message"] == "invalid token", (name, r.text)
        assert r.json()["error"]["code"] == "invalid_token"
    forged = jwt.encode(_claims(s), "some-other-secret-of-sufficient-len", algorithm="HS256")
    r = await _post(app, forged)
    assert r.json()["error"]["message"] == "invalid token: signature verification failed", r.text
