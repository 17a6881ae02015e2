# The root a user applies: its variables reach the module, its outputs come from it, and its own
# variables (region, aws_endpoint_url) are validated. The module's own tests are in
# modules/heteroplane/tests/. A mock AWS provider: nothing is created.

mock_provider "aws" {
  # What the region offers (workers.tf, network.tf check the candidate types and the zones).
  mock_data "aws_ec2_instance_type_offerings" {
    defaults = {
      instance_types = ["c5.xlarge", "c5n.2xlarge", "c6i.large", "g4dn.2xlarge", "g4dn.xlarge", "g5.xlarge", "r5n.large", "t3.large"]
    }
  }
  mock_data "aws_availability_zones" {
    defaults = {
      names = ["eu-west-1a", "eu-west-1b", "eu-west-1c"]
    }
  }
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\": \"2012-10-17\", \"Statement\": []}"
    }
  }
}

variables {
  region                = "eu-west-1"
  api_allowed_cidr      = "192.0.2.0/24"
  worker_ami_id         = "ami-0123456789abcdef0"
  heteroplane_git_url   = "https://example.com/heteroplane.git"
  availability_zones    = ["eu-west-1a", "eu-west-1b"]
  worker_instance_types = ["g5.xlarge", "c6i.large"]
  name                  = "hp-test"
  allow_plain_http      = true
}

run "variables_reach_the_module" {
  command = plan

  assert {
    condition     = output.launch_template_names == { "g5.xlarge" = "hp-test-g5.xlarge", "c6i.large" = "hp-test-c6i.large" }
    error_message = "a launch template per candidate type, named after the deployment"
  }
  assert {
    condition     = output.admin_token_ssm_parameter == "/hp-test/admin-token"
    error_message = "the admin token's parameter is named after the deployment"
  }
  assert {
    condition     = output.app_defaults.instance_types == tolist(["g5.xlarge", "c6i.large"])
    error_message = "the candidate types reach the app defaults"
  }
}

run "region_must_be_a_region" {
  command = plan
  variables {
    region = "Europe"
  }
  expect_failures = [var.region]
}

run "endpoint_must_be_a_url" {
  command = plan
  variables {
    aws_endpoint_url = "127.0.0.1:5000"
  }
  expect_failures = [var.aws_endpoint_url]
}
