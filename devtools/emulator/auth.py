"""Bearer-token authentication of the emulator's API requests, off until a test turns it on.

A kube-apiserver authenticates every request before anything else looks at it. With its
:class:`TokenAuth` enabled (``Emulator.auth.enabled``, ``POST /_emulator/auth``, ``--auth``),
the emulator does too: a request whose
``Authorization: Bearer <token>`` names a token the emulator accepts acts as that token's user;
any other request (no token, an unknown one, a revoked one) is answered 401 with the Status a
kube-apiserver writes (``filters.Unauthorized``: ``apierrors.NewUnauthorized("Unauthorized")``,
negotiated to JSON), and nothing else happens to it. A missing token is answered 401 too, as a
server with anonymous authentication off does (with it on the request would act as
``system:anonymous`` and meet RBAC's 403 instead).

The tokens accepted:

- the ones :meth:`TokenAuth.issue` issued (``POST /_emulator/tokens``) until
  :meth:`TokenAuth.revoke` (``POST /_emulator/tokens/revoke``) revokes them;
- with a ``token_file``, the token the file holds at the time of the request, as the user
  ``token_file_user``: writing a new token into the file revokes the old one at once, as a
  rotated service-account token whose predecessor was revoked (``--token-file``).

The user a token maps to is the user RBAC (``rbac.py``) judges and API Priority and Fairness
(``flowcontrol.py``) counts seats for.
"""

from __future__ import annotations

import secrets
from collections import Counter
from pathlib import Path

from devtools.emulator import statuses as st

DEFAULT_USER = "system:serviceaccount:retired-pod-gc:retired-pod-gc"
"""The user of a token issued without one, and of the token file's token by default."""


def unauthorized() -> st.ApiError:
    """The 401 a kube-apiserver answers a request it cannot authenticate."""
    return st.ApiError(st.status(401, "Unauthorized", "Unauthorized"))


class TokenAuth:
    """The tokens the emulator accepts, and the 401s it answered."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        token_file: Path | None = None,
        token_file_user: str = DEFAULT_USER,
    ) -> None:
        self.enabled = enabled
        """Off: every request is let through unauthenticated (tokens can be issued meanwhile)."""
        self.token_file = token_file
        self.token_file_user = token_file_user
        self._users: dict[str, str] = {}
        """Issued token → its user."""
        self.revoked: set[str] = set()
        self.unauthorized = 0
        """Requests answered 401 so far."""
        self.authenticated: Counter[str] = Counter()
        """User → requests authenticated as that user."""

    def issue(self, user: str = DEFAULT_USER, token: str | None = None) -> str:
        """A new token for ``user`` (or ``token`` itself, accepted from now on)."""
        token = token if token else f"emu-{secrets.token_urlsafe(24)}"
        self._users[token] = user
        self.revoked.discard(token)
        return token

    def revoke(self, token: str) -> bool:
        """Stop accepting ``token``; whether it was an issued one not yet revoked."""
        known = self._users.pop(token, None) is not None
        self.revoked.add(token)
        return known

    def _file_token(self) -> str | None:
        if self.token_file is None:
            return None
        try:
            return self.token_file.read_text().strip() or None
        except OSError:
            return None

    def user_of(self, authorization: str | None) -> str | None:
        """The user an ``Authorization`` header authenticates; ``None``: not authenticated."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or token in self.revoked:
            return None
        user = self._users.get(token)
        if user is None and token == self._file_token():
            user = self.token_file_user
        return user

    def authenticate(self, authorization: str | None) -> str:
        """The request's user; raises the 401 (and counts it) when there is none."""
        user = self.user_of(authorization)
        if user is None:
            self.unauthorized += 1
            raise unauthorized()
        self.authenticated[user] += 1
        return user

    def to_dict(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "unauthorized": self.unauthorized,
            "authenticated": dict(self.authenticated),
            "tokens": len(self._users),
            "revoked": len(self.revoked),
            "token_file": str(self.token_file) if self.token_file is not None else None,
        }
