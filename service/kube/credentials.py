"""Where the ``Authorization`` header comes from, and reading it again when the server refuses it.

A :class:`Credentials` source puts the bearer token into the ``kubernetes_asyncio``
``Configuration`` (``api_key["BearerToken"]``, which the ApiClient sends with every request) and
can :meth:`~Credentials.reload` it. The transport (``service/kube/transport.py``) reloads at the
first 401, as client-go's ``tokenSourceTransport`` does, so that a rotated token costs one
refused request instead of up to a minute of them.

- :class:`TokenFile`: a token file, such as the in-cluster service-account token the kubelet
  rotates. Read at start, again every ``TOKEN_REFRESH_PERIOD`` (the library's in-cluster period,
  one minute; this replaces the library's refresh hook), and at once on :meth:`~TokenFile.reload`.
- :class:`KubeconfigCredentials`: a kubeconfig's user. :meth:`~KubeconfigCredentials.reload`
  loads the kubeconfig again (its ``tokenFile`` read again, its exec plugin run again) and takes
  the new token. Client certificates are the TLS context's and are not reloaded.

A source that cannot be read raises ``OSError`` or ``ValueError``; the transport logs and counts
it, and keeps the old token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import TOKEN_REFRESH_PERIOD

from service.kit import clock

BEARER_TOKEN = "BearerToken"  # noqa: S105 (a key name, not a secret)
"""The ``api_key`` entry of a ``Configuration`` the ApiClient sends as ``authorization``."""


class Credentials(Protocol):
    """A source of the bearer token, read again on demand."""

    @property
    def source(self) -> str:
        """What is read (for logs): a path, or a kubeconfig and its context."""
        ...

    async def reload(self, configuration: k8s_client.Configuration) -> None:
        """Read the credentials again, now, into ``configuration``. Raises ``OSError`` or
        ``ValueError`` when they cannot be read."""
        ...


class TokenFile:
    """A bearer token held in a file, read every ``period_s`` and on :meth:`reload`."""

    def __init__(self, path: str | Path, *, period_s: float | None = None) -> None:
        self.path = Path(path)
        self.period_s = period_s if period_s is not None else TOKEN_REFRESH_PERIOD.total_seconds()
        self._read_at = float("-inf")

    @property
    def source(self) -> str:
        return f"token file {self.path}"

    def install(self, configuration: k8s_client.Configuration) -> None:
        """Read the token into ``configuration`` now and keep it fresh: the configuration's
        refresh hook (called before every request) reads the file again once ``period_s`` has
        passed. Raises as :meth:`reload` does."""
        self._read_into(configuration)
        configuration.refresh_api_key_hook = self._refresh

    async def reload(self, configuration: k8s_client.Configuration) -> None:
        self._read_into(configuration)

    def _refresh(self, configuration: k8s_client.Configuration) -> None:
        if clock.now() - self._read_at < self.period_s:
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
    """The user of a kubeconfig context, loaded again on :meth:`reload`."""

    def __init__(self, path: str | None, *, context: str | None) -> None:
        self.path = path
        self.context = context

    @property
    def source(self) -> str:
        named = self.path or "the default kubeconfig"
        return f"kubeconfig {named}" + (f" (context {self.context})" if self.context else "")

    async def reload(self, configuration: k8s_client.Configuration) -> None:
        fresh = k8s_client.Configuration()
        try:
            await k8s_config.load_kube_config(
                config_file=self.path,
                context=self.context,
                client_configuration=fresh,
                persist_config=False,
            )
        except k8s_config.ConfigException as exc:
            raise ValueError(str(exc)) from exc
        token = fresh.api_key.get(BEARER_TOKEN)
        if token:
            configuration.api_key[BEARER_TOKEN] = token
