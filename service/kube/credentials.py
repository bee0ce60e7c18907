"""Where the ``Authorization`` header comes from, and reading it again when the server refuses it.

A :class:`Credentials` source puts the bearer token into the library's ``Configuration`` and can
:meth:`~Credentials.reload` it; the transport reloads at the first 401, as client-go's
``tokenSourceTransport`` does, so that a rotated token costs one refused request.

- :class:`TokenFile`: a token file, such as the service-account token the kubelet rotates. Read at
  start, again every ``TOKEN_REFRESH_PERIOD`` (the library's in-cluster period, one minute), and
  at once on :meth:`~TokenFile.reload`.
- :class:`KubeconfigCredentials`: a kubeconfig's user, loaded again on reload (its ``tokenFile``
  read again, its exec plugin run again). Client certificates are the TLS context's and are not
  reloaded.

A source that cannot be read raises ``OSError`` or ``ValueError``; :class:`Reauthentication`
logs and counts it, and keeps the old token.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import anyio
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import TOKEN_REFRESH_PERIOD

from service.kit import clock
from service.kit.causelog import CauseLog
from service.metrics import CredentialReload, KubeMetrics

BEARER_TOKEN = "BearerToken"  # noqa: S105 (a key name, not a secret)
"""The ``api_key`` entry of a ``Configuration`` sent as ``authorization``."""


class Credentials(Protocol):
    """A source of the bearer token, read again on demand."""

    source: str
    """What is read (for logs): a path, or a kubeconfig and its context."""

    async def reload(self, configuration: k8s_client.Configuration) -> None:
        """Read the credentials again, now, into ``configuration``. Raises ``OSError`` or
        ``ValueError`` when they cannot be read."""
        ...


class TokenFile:
    """A bearer token held in a file, read every ``TOKEN_REFRESH_PERIOD`` and on :meth:`reload`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.source = f"token file {self.path}"
        self._read_at = float("-inf")

    def install(self, configuration: k8s_client.Configuration) -> None:
        """Read the token into ``configuration`` now, and again once the period has passed at
        the refresh hook (called before every request). Raises as :meth:`reload` does."""
        self._read_into(configuration)
        configuration.refresh_api_key_hook = self._refresh

    async def reload(self, configuration: k8s_client.Configuration) -> None:
        self._read_into(configuration)

    def _refresh(self, configuration: k8s_client.Configuration) -> None:
        if clock.now() - self._read_at < TOKEN_REFRESH_PERIOD.total_seconds():
            return
        try:
            self._read_into(configuration)
        except (OSError, ValueError):
            # The periodic read keeps the token it has; a 401 makes the transport read again,
            # and that failure is logged and counted there.
            self._read_at = clock.now()

    def _read_into(self, configuration: k8s_client.Configuration) -> None:
        token = self.path.read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"{self.path} is empty")
        configuration.api_key[BEARER_TOKEN] = f"Bearer {token}"
        self._read_at = clock.now()


class KubeconfigCredentials:
    """The user of the kubeconfig's current context, loaded again on :meth:`reload`."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.source = f"kubeconfig {path or 'the default kubeconfig'}"

    async def reload(self, configuration: k8s_client.Configuration) -> None:
        fresh = k8s_client.Configuration()
        try:
            await k8s_config.load_kube_config(
                config_file=self.path, client_configuration=fresh, persist_config=False
            )
        except k8s_config.ConfigException as exc:
            raise ValueError(str(exc)) from exc
        token = fresh.api_key.get(BEARER_TOKEN)
        if token:
            configuration.api_key[BEARER_TOKEN] = token


class Reauthentication:
    """The transport's reading of the credentials at a 401, and the refusal that stands after
    it (logged once per cause through ``logger``)."""

    def __init__(
        self,
        configuration: k8s_client.Configuration,
        credentials: Credentials | None,
        *,
        metrics: KubeMetrics,
        logger: logging.Logger,
    ) -> None:
        self._configuration = configuration
        self.credentials = credentials
        """What is read again at a 401 (``None``: nothing, a client without a token)."""
        self._metrics = metrics
        self.generation = 0
        """Counts reloads: a 401 reloads only the credentials it was sent with."""
        self.refused: str | None = None
        """Why the last answer was a 401 that stands (``None``: it was not)."""
        self._lock = anyio.Lock()
        self._auth_log = CauseLog("the Kubernetes API refuses the credentials", logger)
        self._reload_log = CauseLog("could not read the Kubernetes API credentials", logger)
        metrics.api_unauthorized.set(0)

    async def reload(self, generation: int) -> None:
        """Read the credentials again, unless that happened since ``generation``."""
        if self.credentials is None:
            return
        async with self._lock:
            if self.generation != generation:
                return
            before = self._configuration.api_key.get(BEARER_TOKEN)
            try:
                await self.credentials.reload(self._configuration)
            except (OSError, ValueError) as exc:
                self._metrics.api_credential_reloads.labels(result=CredentialReload.FAILED).inc()
                self._reload_log.failed(f"{self.credentials.source}: {exc}")
            else:
                self._reload_log.ok()
                changed = self._configuration.api_key.get(BEARER_TOKEN) != before
                result = CredentialReload.CHANGED if changed else CredentialReload.UNCHANGED
                self._metrics.api_credential_reloads.labels(result=result).inc()
            self.generation += 1

    def refuse(self, cause: str) -> None:
        """A 401 that stands: unready until an answer other than 401 comes."""
        self._metrics.api_unauthorized_answers.inc()
        self._metrics.api_unauthorized.set(1)
        source = self.credentials.source if self.credentials is not None else "no source"
        self._auth_log.failed(f"{cause} (credentials read again from {source})")
        self.refused = cause

    def accept(self) -> None:
        """An answer other than 401."""
        if self.refused is not None:
            self.refused = None
            self._metrics.api_unauthorized.set(0)
            self._auth_log.ok()
