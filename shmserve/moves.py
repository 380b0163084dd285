"""Where clients reach a deployment (nginx's address and scheme), as `apply` may change it:
warned of, refused without --move, and checked free before anything changes."""

from __future__ import annotations

import socket
import sys
from typing import Callable

from shmserve import remote, tls
from shmserve.config import Config
from shmserve.prechecks import CliError, check_port


def check(old: Config, new: Config, move: bool, dry_run: bool,
          say: Callable[..., None]) -> None:
    """Say how `new` moves the deployment from `old`, if it does; refuse it (CliError) without
    `move`, unless a dry run, which says so."""
    moved = new.server.port != old.server.port or not same_listen(old, new)
    if moved:
        check_address(old, new)
        # listed above among the keys, but easy to miss (an outside check's apply left out
        # `up`'s SHMSERVE__SERVER__PORT and moved the deployment to the default port)
        scheme = (f" (and from {tls.scheme(old)}:// to {tls.scheme(new)}://)"
                  if tls.enabled(new) != tls.enabled(old) else "")
        say(f"shmserve: warning: nginx moves from {old.server.host}:{old.server.port} to "
            f"{new.server.host}:{new.server.port}{scheme}: clients of the old address lose it "
            "(was the address an override of `up`'s, that this command must be given again?)",
            sys.stderr)
    if tls.enabled(new) != tls.enabled(old) and not moved:  # the same address, another scheme
        moved = True
        say(f"shmserve: warning: nginx moves from {remote.base_url(old)} to "
            f"{remote.base_url(new)}: clients of the old scheme get "
            + ("a 400 (plain HTTP on the TLS port)" if tls.enabled(new) else
               "a failed TLS handshake"), sys.stderr)
    if new.nginx.tls_client_ca and new.nginx.tls_client_ca != old.nginx.tls_client_ca \
            and tls.enabled(old):
        say(f"shmserve: warning: nginx asks clients for a certificate {new.nginx.tls_client_ca} "
            "issued (nginx.tls_client_ca) from now on: one without is refused 403 (gRPC "
            "UNAUTHENTICATED) but on the probes", sys.stderr)
    elif old.nginx.tls_client_ca and not new.nginx.tls_client_ca and tls.enabled(new):
        say("shmserve: warning: nginx asks clients for no certificate from now on "
            "(nginx.tls_client_ca is empty): any client that reaches the port is served",
            sys.stderr)
    if new.nginx.tls_client_ca and old.nginx.tls_client_certificate \
            and not new.nginx.tls_client_certificate:
        say("shmserve: warning: this CLI presents no client certificate from now on "
            "(nginx.tls_client_certificate is empty) while nginx asks for one: `status` reads a "
            "frontend's figures, the admin commands (models, reload, split) are refused",
            sys.stderr)
    # Asked for, not only warned of: an outside check's `apply --env prod` in a new shell,
    # without up's overrides, moved a loopback deployment to 0.0.0.0:8080
    moved = _grpc(old, new, say) or moved
    if moved and not move:
        if dry_run:
            say("shmserve: (an apply of this needs --move)", sys.stderr)
        else:
            raise CliError("this apply moves where clients reach the deployment (above): give "
                           "--move to apply it, or the settings `up` was given, again")


def _grpc(old: Config, new: Config, say: Callable[..., None]) -> bool:
    """Check a gRPC port turned on or changed free (on a new host, check_address checks it);
    whether gRPC's clients lose their port (a move)."""
    before, after = old.server.grpc_port, new.server.grpc_port
    if after and after != before and same_listen(old, new):
        check_port(new, ("server.grpc_port",))
    if not before or after == before:
        return False
    where = f"port {after}" if after else "nowhere (server.grpc_port 0)"
    say(f"shmserve: warning: gRPC moves from port {before} to {where}: its clients lose the "
        "old port", sys.stderr)
    return True


def listen_addresses(cfg: Config) -> frozenset:
    """The socket addresses nginx binds for server.host (a name resolved as nginx resolves it;
    empty where it does not resolve)."""
    try:
        found = socket.getaddrinfo(cfg.server.host, cfg.server.port, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset((family, address[:2]) for family, _, _, _, address in found)


def same_listen(old: Config, new: Config) -> bool:
    """The same host, or another spelling of it (localhost for 127.0.0.1) that binds the same
    sockets: nginx keeps its listening socket over the reload and no client moves."""
    if new.server.host == old.server.host:
        return True
    addresses = listen_addresses(new)
    return bool(addresses) and addresses == listen_addresses(old)


def check_address(old: Config, new: Config) -> None:
    """The new address must be free; on the same port, the one that holds it may be this
    deployment's own nginx (a wildcard address overlaps every other, and a name may resolve to
    the old address among others: localhost to 127.0.0.1 and ::1): nginx cannot take the new
    one while it holds the old, so that change needs a new start."""
    try:
        # the gRPC port too on a new host; on the same one this deployment's nginx holds it
        check_port(new, ("server.port",) if same_listen(old, new) else
                   ("server.port", "server.grpc_port"))
    except CliError:
        if new.server.port == old.server.port and (
                {old.server.host, new.server.host} & {"0.0.0.0", "::"}
                or listen_addresses(old) & listen_addresses(new)):
            raise CliError(f"server.host: {old.server.host} -> {new.server.host} on the same port "
                           f"{new.server.port}: this deployment's nginx holds the old address, "
                           "which overlaps the new; `shmserve down`, then `shmserve up` to "
                           "change it (or was the host an override or --env of `up`'s that "
                           "this command left out?)") from None
        raise
