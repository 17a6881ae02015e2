# The variables' validation blocks: each bad value is refused by its own variable. A mock AWS
# provider: nothing is created, nothing needs credentials.

mock_provider "aws" {
  # Policy documents feed arguments the provider checks as JSON: a mock's random string is not.
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\": \"2012-10-17\", \"Statement\": []}"
    }
  }
}

variables {
  api_allowed_cidr      = "203.0.113.0/24"
  worker_ami_id         = "ami-0123456789abcdef0"
  heteroplane_git_url   = "https://example.com/heteroplane.git"
  availability_zones    = ["us-east-1a", "us-east-1b"]
  worker_instance_types = ["g4dn.xlarge", "c5.xlarge"]
  allow_plain_http      = true
}

run "good_values_plan" {
  command = plan
}

run "api_cidr_must_be_a_cidr" {
  command = plan
  variables {
    api_allowed_cidr = "not-a-cidr"
  }
  expect_failures = [var.api_allowed_cidr]
}

run "api_cidr_needs_a_prefix_length" {
  command = plan
  variables {
    api_allowed_cidr = "203.0.113.7"
  }
  expect_failures = [var.api_allowed_cidr]
}

run "api_cidr_host_bits_must_be_zero" {
  command = plan
  variables {
    api_allowed_cidr = "203.0.113.7/24"
  }
  expect_failures = [var.api_allowed_cidr]
}

run "api_cidr_is_ipv4" {
  command = plan
  variables {
    api_allowed_cidr = "2001:db8::/32"
  }
  expect_failures = [var.api_allowed_cidr]
}

run "api_cidr_refuses_the_whole_internet" {
  command = plan
  variables {
    api_allowed_cidr = "0.0.0.0/0"
  }
  expect_failures = [var.api_allowed_cidr]
}

run "api_cidr_refuses_the_whole_ipv6_internet" {
  command = plan
  variables {
    api_allowed_cidr = "::/0"
  }
  expect_failures = [var.api_allowed_cidr]
}

run "api_cidr_takes_the_whole_internet_when_allowed" {
  command = plan
  variables {
    api_allowed_cidr = "0.0.0.0/0"
    allow_public_api = true
  }
  assert {
    condition     = aws_security_group_rule.api.cidr_blocks == tolist(["0.0.0.0/0"])
    error_message = "allow_public_api lets the API be open to everyone"
  }
}

run "plain_http_needs_consent" {
  command = plan
  variables {
    allow_plain_http = false
  }
  expect_failures = [var.allow_plain_http]
}

run "a_certificate_needs_no_consent" {
  command = plan
  variables {
    allow_plain_http    = false
    api_certificate_arn = "arn:aws:acm:us-east-1:123456789012:certificate/0a1b2c3d-0000-4000-8000-00000000000f"
  }
}

run "certificate_is_an_acm_arn" {
  command = plan
  variables {
    api_certificate_arn = "arn:aws:iam::123456789012:server-certificate/api"
  }
  expect_failures = [var.api_certificate_arn]
}

run "domain_is_a_dns_name" {
  command = plan
  variables {
    api_domain_name = "https://api.example.com"
  }
  expect_failures = [var.api_domain_name]
}

run "existing_vpc_with_a_certificate_needs_load_balancer_subnets" {
  command = plan
  variables {
    vpc_id                   = "vpc-0123456789abcdef0"
    control_plane_subnet_id  = "subnet-0000000000000000a"
    worker_subnet_ids        = ["subnet-0000000000000000b"]
    api_certificate_arn      = "arn:aws:acm:us-east-1:123456789012:certificate/0a1b2c3d-0000-4000-8000-00000000000f"
    load_balancer_subnet_ids = ["subnet-0000000000000000a"]
  }
  override_data {
    target = data.aws_subnet.worker
    values = {
      map_public_ip_on_launch = false
    }
  }
  expect_failures = [var.load_balancer_subnet_ids]
}

run "worker_types_must_be_allowed" {
  command = plan
  variables {
    worker_instance_types = ["g4dn.xlarge", "p5.48xlarge"]
  }
  expect_failures = [var.worker_instance_types]
}

run "allowed_types_may_be_narrowed" {
  command = plan
  variables {
    worker_instance_types  = ["g4dn.xlarge"]
    allowed_instance_types = ["g4dn.xlarge", "g4dn.2xlarge"]
  }
}

run "allowed_types_must_not_be_empty" {
  command = plan
  variables {
    allowed_instance_types = []
  }
  expect_failures = [var.allowed_instance_types]
}

run "worker_types_must_not_be_empty" {
  command = plan
  variables {
    worker_instance_types = []
  }
  expect_failures = [var.worker_instance_types]
}

run "worker_types_must_be_type_names" {
  command = plan
  variables {
    worker_instance_types = ["g4dn.xlarge", "a big GPU"]
  }
  expect_failures = [var.worker_instance_types]
}

run "worker_types_must_not_repeat" {
  command = plan
  variables {
    worker_instance_types = ["t3.large", "t3.large"]
  }
  expect_failures = [var.worker_instance_types]
}

run "budget_must_be_positive" {
  command = plan
  variables {
    default_budget_usd_per_hr = -1
  }
  expect_failures = [var.default_budget_usd_per_hr]
}

run "budget_must_not_be_zero" {
  command = plan
  variables {
    default_budget_usd_per_hr = 0
  }
  expect_failures = [var.default_budget_usd_per_hr]
}

run "slo_latency_must_be_positive" {
  command = plan
  variables {
    default_slo_latency_ms = 0
  }
  expect_failures = [var.default_slo_latency_ms]
}

run "slo_percentile_below_100" {
  command = plan
  variables {
    default_slo_percentile = 100
  }
  expect_failures = [var.default_slo_percentile]
}

run "database_is_sqlite_or_postgresql" {
  command = plan
  variables {
    database = "mysql"
  }
  expect_failures = [var.database]
}

run "ami_must_be_an_ami_id" {
  command = plan
  variables {
    worker_ami_id = "ubuntu-24.04"
  }
  expect_failures = [var.worker_ami_id]
}

run "git_url_must_be_https" {
  command = plan
  variables {
    heteroplane_git_url = "git@github.com:heteroplane/heteroplane.git"
  }
  expect_failures = [var.heteroplane_git_url]
}

run "git_url_without_shell_characters" {
  command = plan
  variables {
    heteroplane_git_url = "https://example.com/x.git'; rm -rf /"
  }
  expect_failures = [var.heteroplane_git_url]
}

run "name_is_a_short_slug" {
  command = plan
  variables {
    name = "Heteroplane_Prod"
  }
  expect_failures = [var.name]
}

run "existing_vpc_needs_worker_subnets" {
  command = plan
  variables {
    vpc_id                  = "vpc-0123456789abcdef0"
    control_plane_subnet_id = "subnet-0123456789abcdef0"
  }
  expect_failures = [var.worker_subnet_ids]
}

run "existing_vpc_needs_a_control_plane_subnet" {
  command = plan
  variables {
    vpc_id            = "vpc-0123456789abcdef0"
    worker_subnet_ids = ["subnet-0123456789abcdef1"]
  }
  expect_failures = [var.control_plane_subnet_id]
}

run "vpc_cidr_size" {
  command = plan
  variables {
    vpc_cidr = "10.0.0.0/8"
  }
  expect_failures = [var.vpc_cidr]
}

run "ports_are_unprivileged" {
  command = plan
  variables {
    api_port = 80
  }
  expect_failures = [var.api_port]
}

run "kms_key_is_an_arn" {
  command = plan
  variables {
    kms_key_arn = "my-key"
  }
  expect_failures = [var.kms_key_arn]
}
