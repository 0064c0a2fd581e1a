"""The Hugging Face Hub from ``ttr eval lm``: go offline at once when it cannot be reached, and say
what to do when a task's dataset is not available.

Without this, lm-eval (through ``datasets``) retries the Hub for about half a minute per dataset
and then fails with a traceback. The check is one TCP connection with a short timeout, made only
when the user has not chosen a mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) and no proxy is
configured (a proxy may reach what a direct connection cannot). It must run before ``datasets``
is imported, which reads these variables once.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

from ttr.errors import TTRError, one_line

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")
OFFLINE_HELP = (
    "without the Hub, use datasets already in the Hugging Face cache (download them where the Hub is reachable, "
    "copy ~/.cache/huggingface here and set HF_DATASETS_OFFLINE=1) or a local task: --include-path DIR with a "
    "task YAML whose data_files are local (see README, 'Evaluating offline')"
)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within ``timeout`` seconds (name lookup
    included, which has no timeout of its own, hence the thread)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    ok = []

    def connect():
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return bool(ok)


def offline_if_unreachable() -> str | None:
    """Switch this process to offline mode when the Hub cannot be reached; returns a note then."""
    if any(v in os.environ for v in OFFLINE_VARS + PROXY_VARS) or hub_reachable():
        return None
    for v in OFFLINE_VARS:
        os.environ[v] = "1"
    return "the Hugging Face Hub is not reachable: using cached datasets only (HF_HUB_OFFLINE=1)"


def is_offline_error(err: BaseException) -> bool:
    """A failed download: a connection error, or the hub client's offline / not-in-cache errors,
    possibly as the cause of another error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ in (
            "OfflineModeIsEnabled", "LocalEntryNotFoundError"
        ):
            return True
        err = err.__cause__ or err.__context__
    return False


def dataset_unavailable(err: BaseException) -> TTRError:
    return TTRError(f"a task's dataset cannot be downloaded ({one_line(str(err))}); {OFFLINE_HELP}")
