"""Building the ``kubernetes_asyncio`` ApiClient: in-cluster, from a kubeconfig, or a plain URL.

The explicit URL is how the emulator (tests, demo, benchmarks) is reached; production uses the
in-cluster service account, and a developer's ``KUBECONFIG`` works too. Must be called on the
event loop (the client owns an aiohttp session).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

logger = logging.getLogger(__name__)

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
KUBECONFIG_DEFAULT = "~/.kube/config"


class ApiConfigError(RuntimeError):
    """No usable Kubernetes connection configuration was found."""


async def new_api_client(
    *,
    host: str | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
    env: Mapping[str, str] | None = None,
    pool_size: int = 32,
) -> k8s_client.ApiClient:
    """An ApiClient for ``host`` when given, else in-cluster when running in a pod, else the
    kubeconfig (``kubeconfig`` argument, ``KUBECONFIG``, then ``~/.kube/config``)."""
    environ = os.environ if env is None else env
    configuration = k8s_client.Configuration()
    if host:
        configuration.host = host.rstrip("/")
        source = "explicit host"
    elif kubeconfig is None and environ.get(IN_CLUSTER_ENV):
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        source = "in-cluster service account"
    else:
        path = kubeconfig or (environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None)
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
                config_file=path,
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
        except (k8s_config.ConfigException, OSError) as exc:
            raise ApiConfigError(f"no Kubernetes configuration: {exc}") from exc
        source = f"kubeconfig {path or KUBECONFIG_DEFAULT}"
    configuration.connection_pool_maxsize = pool_size
    logger.info("kubernetes api %s (%s)", configuration.host, source)
    return k8s_client.ApiClient(configuration)
