"""Who may do what on the plane's NATS server (`plane auth`): roles with least privilege in
the plane's own account, and tenants as accounts that import its inference service.

`roles` (the allow lists, pure), `conf` (nats.conf), `store` (the auth directory: secrets,
tenants, reload), `live` (tenants' settings into PLANE_CONFIG), `cli` (the commands).
"""
