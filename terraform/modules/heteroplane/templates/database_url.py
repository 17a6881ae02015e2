"""Print the control plane's PostgreSQL URL, built from the RDS-managed master secret.

Run by /opt/heteroplane/bin/heteroplane-start at every start (so a rotated password is picked
up by a restart); the password is in no file and not in terraform's state.
"""

import json
import os
from urllib.parse import quote

import boto3


def main() -> None:
    secrets = boto3.client("secretsmanager", region_name=os.environ["HP_REGION"])
    secret = secrets.get_secret_value(SecretId=os.environ["HP_DATABASE_SECRET_ARN"])
    value = json.loads(secret["SecretString"])
    user = quote(value["username"], safe="")
    password = quote(value["password"], safe="")
    host = os.environ["HP_DATABASE_HOST"]
    port = os.environ["HP_DATABASE_PORT"]
    name = os.environ["HP_DATABASE_NAME"]
    print(f"postgresql://{user}:{password}@{host}:{port}/{name}?sslmode=require")


if __name__ == "__main__":
    main()
