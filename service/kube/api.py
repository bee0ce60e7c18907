"""Connecting to the API server: in-cluster, from a kubeconfig, or a plain URL (the emulator's).

The library only loads the configuration; every request goes through the
:class:`~service.kube.transport.ApiTransport` made of it, which reads the credentials again at
the first 401 (as client-go's ``tokenSourceTransport``), so that a rotated token costs one
refused request. A credentials source that cannot be read raises ``OSError`` or ``ValueError``;
client certificates are the TLS context's and are not reloaded. Must be called on the event loop
(the transport owns aiohttp sessions).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import SERVICE_TOKEN_FILENAME, TOKEN_REFRESH_PERIOD

from service.kit import clock
from service.kube.transport import BEARER_TOKEN, ApiTransport, Credentials
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
KUBECONFIG_DEFAULT = "~/.kube/config"


class ApiConfigError(RuntimeError):
    """No usable Kubernetes connection configuration was found."""


class TokenFile:
    """A bearer token held in a file (the service account's, which the kubelet rotates), read
    every ``TOKEN_REFRESH_PERIOD`` (the library's in-cluster period, a minute) and on
    :meth:`reload`."""

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
    """The user of the kubeconfig's current context, loaded again on :meth:`reload` (its
    ``tokenFile`` read again, its exec plugin run again)."""

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


async def new_api_client(
    *,
    host: str | None = None,
    env: Mapping[str, str] | None = None,
    pool_size: int = 32,
    token_file: str | None = None,
    metrics: KubeMetrics | None = None,
) -> ApiTransport:
    """The transport to ``host`` when given (with the token of ``token_file``, if any), else
    in-cluster when running in a pod (the token of ``token_file``, by default the service
    account's), else the kubeconfig (``KUBECONFIG``, then ``~/.kube/config``), counting into
    ``metrics``."""
    environ = os.environ if env is None else env
    configuration = k8s_client.Configuration()
    credentials: Credentials | None = None
    if host:
        configuration.host = host.rstrip("/")
        source = "explicit host"
        if token_file:
            credentials = _token_file(token_file, configuration)
    elif environ.get(IN_CLUSTER_ENV):
        token_path = token_file or SERVICE_TOKEN_FILENAME
        try:
            # Host and CA from the library; the token is the TokenFile's, which replaces the
            # library's refresh hook with its own (read once a minute, and at once at a 401).
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration,
                try_refresh_token=False,
                token_filename=token_path,
                environ=environ,
            )
        except k8s_config.ConfigException as exc:
            raise ApiConfigError(f"in-cluster configuration: {exc}") from exc
        credentials = _token_file(token_path, configuration)
        source = "in-cluster service account"
    else:
        path = environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
        # One stat of a local file before load_kube_config reads it (as blocking): so that no
        # file at all is named as such, not as a kubeconfig without a current-context.
        if not os.path.exists(os.path.expanduser(path or KUBECONFIG_DEFAULT)):  # noqa: ASYNC240
            named = f"KUBECONFIG={path}" if path else KUBECONFIG_DEFAULT
            raise ApiConfigError(
                f"no kubeconfig and no in-cluster configuration found: {named} does not "
                f"exist and {IN_CLUSTER_ENV} is unset (run in a pod, or set KUBECONFIG to a "
                "kubeconfig file)"
            )
        try:
            await k8s_config.load_kube_config(
                config_file=path, client_configuration=configuration, persist_config=False
            )
        except (k8s_config.ConfigException, OSError) as exc:
            raise ApiConfigError(f"no Kubernetes configuration: {exc}") from exc
        credentials = KubeconfigCredentials(path)
        source = f"kubeconfig {path or KUBECONFIG_DEFAULT}"
    logger.info("kubernetes api %s (%s)", configuration.host, source)
    return ApiTransport(
        configuration,
        pool_size=pool_size,
        metrics=metrics if metrics is not None else KubeMetrics(),
        credentials=credentials,
    )


def _token_file(path: str, configuration: k8s_client.Configuration) -> TokenFile:
    source = TokenFile(path)
    try:
        source.install(configuration)
    except (OSError, ValueError) as exc:
        raise ApiConfigError(f"cannot read the token file {path}: {exc}") from exc
    return source
