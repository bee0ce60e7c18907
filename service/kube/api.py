"""Connecting to the API server: in-cluster, from a kubeconfig, or a plain URL (the emulator's).

The library only loads the configuration; every request goes through the
:class:`~service.kube.transport.ApiTransport` made of it, with the credentials it reads again at
a 401 (``service/kube/credentials.py``). Must be called on the event loop (the transport owns
aiohttp sessions).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import SERVICE_TOKEN_FILENAME

from service.kube.credentials import Credentials, KubeconfigCredentials, TokenFile
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
KUBECONFIG_DEFAULT = "~/.kube/config"


class ApiConfigError(RuntimeError):
    """No usable Kubernetes connection configuration was found."""


async def new_api_client(
    *,
    host: str | None = None,
    env: Mapping[str, str] | None = None,
    pool_size: int = 32,
    token_file: str | None = None,
    metrics: KubeMetrics | None = None,
) -> ApiTransport:
    """The transport to ``host`` when given, else in-cluster when running in a pod, else the
    kubeconfig (``KUBECONFIG``, then ``~/.kube/config``), counting into ``metrics``.

    ``token_file``: the bearer token's file with an explicit host (none: no token), and in-cluster
    the service-account token's (default ``/var/run/secrets/kubernetes.io/serviceaccount/token``).
    """
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
