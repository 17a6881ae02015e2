"""Mint the control plane's admin token once and keep it in SSM Parameter Store.

Run by /opt/heteroplane/bin/heteroplane-start before every `heteroplane serve`, as the service's
user. The token never passes through terraform: terraform creates the parameter with a
placeholder (a write-only value) and this script overwrites it. Idempotent: when the database
already has an active token of ours and the parameter holds a token, it does nothing; otherwise
(a fresh database, or a token that never reached the parameter) it mints a new one, stores it,
and revokes the older ones.
"""

import json
import os
import subprocess
import time

import boto3

HETEROPLANE = "/opt/heteroplane/venv/bin/heteroplane"
PREFIX = "terraform-admin"


def heteroplane(*args: str) -> str:
    done = subprocess.run([HETEROPLANE, *args], check=True, capture_output=True, text=True)
    return done.stdout


def main() -> None:
    ssm = boto3.client("ssm", region_name=os.environ["HP_REGION"])
    parameter = os.environ["HP_ADMIN_TOKEN_PARAMETER"]
    stored = ssm.get_parameter(Name=parameter, WithDecryption=True)["Parameter"]["Value"]
    tokens = json.loads(heteroplane("token", "list", "--json"))["tokens"]
    ours = [t["name"] for t in tokens if t["name"].startswith(PREFIX) and not t["revoked_at"]]
    if ours and stored.startswith("hp_"):
        return
    name = f"{PREFIX}-{int(time.time())}"
    token = heteroplane("token", "create", "--scope", "admin", "--name", name).strip()
    ssm.put_parameter(
        Name=parameter,
        Value=token,
        Type="SecureString",
        KeyId=os.environ["HP_KMS_KEY_ARN"],
        Overwrite=True,
    )
    for old in ours:
        heteroplane("token", "revoke", "--name", old)
    print(f"admin token {name} stored in {parameter}")


if __name__ == "__main__":
    main()
