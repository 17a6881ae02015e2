terraform {
  # 1.9: validation blocks that refer to other variables; 1.11: write-only arguments (the admin
  # token's parameter); mock_provider in `terraform test` (tests/) needs 1.7.
  required_version = ">= 1.11"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # Tested with 5.100.0 (the write-only value_wo of aws_ssm_parameter needs a recent 5.x).
      version = "~> 5.0"
    }
  }
}
