# The module configures no provider of its own: the root that calls it does (../../providers.tf),
# so it can be called from any configuration, with for_each or count, in any account and region.
terraform {
  # 1.9: validation blocks that refer to other variables; 1.11: write-only arguments (the admin
  # token's parameter is created with value_wo, so the token never enters the state).
  required_version = ">= 1.11"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.0"
    }
  }
}
