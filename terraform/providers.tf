# The one provider configuration: the module itself configures none. aws_endpoint_url is for
# tests against a moto server on 127.0.0.1 (tests/integration/test_terraform.py): every service
# at that URL, and no checks that need real AWS credentials (the account id is still asked for:
# moto answers, and rules that refer to a security group are compared with it). On AWS it stays
# null and the provider behaves as usual (credentials from the environment, a profile, a role).

locals {
  endpoint_override = var.aws_endpoint_url != null
}

provider "aws" {
  region = var.region

  skip_credentials_validation = local.endpoint_override
  skip_metadata_api_check     = local.endpoint_override
  s3_use_path_style           = local.endpoint_override

  endpoints {
    ec2            = var.aws_endpoint_url
    elbv2          = var.aws_endpoint_url
    iam            = var.aws_endpoint_url
    kms            = var.aws_endpoint_url
    rds            = var.aws_endpoint_url
    s3             = var.aws_endpoint_url
    secretsmanager = var.aws_endpoint_url
    ssm            = var.aws_endpoint_url
    sts            = var.aws_endpoint_url
  }
}
