"""``kvstrata admin``: operator tasks (rotating the admin key)."""

from __future__ import annotations

import grpc
import typer

from cli.options import GatewayOpt
from cli.output import console, die, fail
from cli.state import admin_key_file, admin_metadata, gateway_address
from kvstrata.v1 import admin_pb2, admin_pb2_grpc
from tenants.keys import new_api_key, write_key_file

admin_app = typer.Typer(help="Operator tasks: rotate the admin key.", no_args_is_help=True)


@admin_app.command("rotate-key")
def admin_rotate_key(
    local: bool = typer.Option(False, "--local", metavar="", help="rotate in the tenant database of the state dir "
                               "directly (when the admin key is lost; run where `kvstrata up` ran)"),
    gateway: str | None = GatewayOpt,
) -> None:
    """Replace the admin key and save the new one to the state dir's admin_key file (0600).

    Over gRPC with the current admin key by default; `--local` needs no key: it writes the
    new key file first, then commits its hash to the tenant database.
    """
    path = admin_key_file()
    if local:
        db = path.parent / "tenants.sqlite"
        if not db.exists():
            die(f"no tenant database at {db}")
        from tenants.store import TenantStore

        key = new_api_key()
        write_key_file(path, key)
        store = TenantStore(db)
        try:
            store.set_admin_key(key)
        finally:
            store.close()
    else:
        with grpc.insecure_channel(gateway_address(gateway)) as ch:
            try:
                key = admin_pb2_grpc.AdminServiceStub(ch).RotateAdminKey(
                    admin_pb2.RotateAdminKeyRequest(), metadata=admin_metadata(), timeout=30).api_key
            except grpc.RpcError as err:
                fail(err)
        try:
            write_key_file(path, key)
        except OSError as exc:
            die(f"could not save the new admin key to {path} ({exc}); it is: {key}")
    console.print(f"admin key rotated; the new key is in {path} (the old one no longer works)")
