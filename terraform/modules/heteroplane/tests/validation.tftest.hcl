# The variables' validation blocks: each bad value is refused by its own variable. A mock AWS
# provider: nothing is created, nothing needs credentials.
#
# A run costs a plan (about two seconds of CPU, the provider's schema loaded again), so the bad
# values go several to a run: one per variable, each variable in expect_failures, and a run
# fails when any one of them is not refused. Never together in a run: a variable whose
# validation reads another (worker_instance_types reads allowed_instance_types,
# allow_plain_http api_certificate_arn, load_balancer_subnet_ids vpc_id and
# api_certificate_arn) with a bad value of the one it reads, whose failure stops its check.

mock_provider "aws" {
  mock_data "aws_region" {
    defaults = {
      name = "us-east-1"
    }
  }
  # What the region offers (workers.tf, network.tf check the candidate types and the zones).
  mock_data "aws_ec2_instance_type_offerings" {
    defaults = {
      instance_types = ["c5.xlarge", "c5n.2xlarge", "c6i.large", "g4dn.2xlarge", "g4dn.xlarge", "g5.xlarge", "r5n.large", "t3.large"]
    }
  }
  mock_data "aws_availability_zones" {
    defaults = {
      names = ["us-east-1a", "us-east-1b", "us-east-1c"]
    }
  }
  # Policy documents feed arguments the provider checks as JSON: a mock's random string is not.
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\": \"2012-10-17\", \"Statement\": []}"
    }
  }
}

# An existing VPC's subnets are in that VPC, the workers' private (a run may say otherwise).
override_data {
  target = data.aws_subnet.control_plane
  values = {
    vpc_id            = "vpc-0123456789abcdef0"
    availability_zone = "us-east-1a"
  }
}

override_data {
  target = data.aws_subnet.worker
  values = {
    map_public_ip_on_launch = false
    vpc_id                  = "vpc-0123456789abcdef0"
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

# What is allowed: the whole internet with consent, a narrower list of allowed types; a
# certificate instead of consent to plain HTTP (a run of its own: the API's rule is then the
# load balancer's).
run "public_api_with_consent_and_narrowed_types_plan" {
  command = plan
  variables {
    api_allowed_cidr       = "0.0.0.0/0"
    allow_public_api       = true
    worker_instance_types  = ["g4dn.xlarge"]
    allowed_instance_types = ["g4dn.xlarge", "g4dn.2xlarge"]
    heteroplane_git_ref    = "16ee9b2a0c6f4e3d8b7a9c1e2f3d4b5a6c7e8f90" # a whole commit id
  }
  assert {
    condition     = aws_security_group_rule.api.cidr_blocks == tolist(["0.0.0.0/0"])
    error_message = "allow_public_api lets the API be open to everyone"
  }
}

run "a_certificate_needs_no_consent" {
  command = plan
  variables {
    allow_plain_http    = false
    api_certificate_arn = "arn:aws:acm:us-east-1:123456789012:certificate/0a1b2c3d-0000-4000-8000-00000000000f"
  }
}

run "bad_values_1" {
  command = plan
  variables {
    api_allowed_cidr          = "not-a-cidr"                   # not a CIDR
    worker_instance_types     = ["g4dn.xlarge", "p5.48xlarge"] # not an allowed type
    default_budget_usd_per_hr = -1                             # negative
    database                  = "mysql"                        # not sqlite or postgresql
    name                      = "Heteroplane_Prod"             # not a short slug
  }
  expect_failures = [
    var.api_allowed_cidr,
    var.worker_instance_types,
    var.default_budget_usd_per_hr,
    var.database,
    var.name,
  ]
}

run "bad_values_2" {
  command = plan
  variables {
    api_allowed_cidr          = "203.0.113.7"                                      # no prefix length
    worker_instance_types     = []                                                 # empty
    default_budget_usd_per_hr = 0                                                  # zero
    worker_ami_id             = "ubuntu-24.04"                                     # not an AMI id
    vpc_cidr                  = "10.0.0.0/8"                                       # too large
    api_certificate_arn       = "arn:aws:iam::123456789012:server-certificate/api" # not ACM's
  }
  expect_failures = [
    var.api_allowed_cidr,
    var.worker_instance_types,
    var.default_budget_usd_per_hr,
    var.worker_ami_id,
    var.vpc_cidr,
    var.api_certificate_arn,
  ]
}

run "bad_values_3" {
  command = plan
  variables {
    api_allowed_cidr       = "203.0.113.7/24"                             # host bits set
    worker_instance_types  = ["g4dn.xlarge", "a big GPU"]                 # not a type name
    default_slo_latency_ms = 0                                            # not positive
    heteroplane_git_url    = "git@github.com:heteroplane/heteroplane.git" # not https
    api_port               = 80                                           # privileged
  }
  expect_failures = [
    var.api_allowed_cidr,
    var.worker_instance_types,
    var.default_slo_latency_ms,
    var.heteroplane_git_url,
    var.api_port,
  ]
}

run "bad_values_4" {
  command = plan
  variables {
    api_allowed_cidr       = "2001:db8::/32"                        # not IPv4
    worker_instance_types  = ["t3.large", "t3.large"]               # repeated
    default_slo_percentile = 100                                    # not below 100
    heteroplane_git_url    = "https://example.com/x.git'; rm -rf /" # shell characters
    kms_key_arn            = "my-key"                               # not an ARN
  }
  expect_failures = [
    var.api_allowed_cidr,
    var.worker_instance_types,
    var.default_slo_percentile,
    var.heteroplane_git_url,
    var.kms_key_arn,
  ]
}

run "bad_values_5" {
  command = plan
  variables {
    api_allowed_cidr       = "0.0.0.0/0"               # the whole internet, without consent
    allowed_instance_types = []                        # empty
    api_domain_name        = "https://api.example.com" # not a DNS name
    heteroplane_git_ref    = "3f2a9c1"                 # a short commit id: cannot be fetched
  }
  expect_failures = [
    var.api_allowed_cidr,
    var.allowed_instance_types,
    var.api_domain_name,
    var.heteroplane_git_ref,
  ]
}

run "bad_values_6" {
  command = plan
  variables {
    api_allowed_cidr          = "::/0"  # the whole IPv6 internet, without consent
    allow_plain_http          = false   # plain HTTP without consent (no certificate)
    worker_volume_size_gib    = 8.5     # not whole (the AWS provider panicked on it)
    sqlite_volume_size_gib    = 20.5    # not whole
    db_allocated_storage_gib  = 20.5    # not whole
    default_budget_usd_per_hr = 0.00001 # below what an app spec takes
    default_slo_latency_ms    = 1e12    # past what an app spec takes
  }
  expect_failures = [
    var.api_allowed_cidr,
    var.allow_plain_http,
    var.worker_volume_size_gib,
    var.sqlite_volume_size_gib,
    var.db_allocated_storage_gib,
    var.default_budget_usd_per_hr,
    var.default_slo_latency_ms,
  ]
}

run "bad_values_7" {
  command = plan
  variables {
    name        = "hp-"                                           # ends in '-' (RDS refuses it)
    kms_key_arn = "arn:aws:kms:us-east-1:123456789012:alias/mine" # an alias's ARN, not a key's
  }
  expect_failures = [
    var.name,
    var.kms_key_arn,
  ]
}

# Subnets of another VPC than vpc_id: the role launches into vpc_id only and the security
# groups are made there, so nothing could run; refused at plan, naming the subnets.
run "existing_vpc_needs_its_own_worker_subnets" {
  command = plan
  variables {
    vpc_id                  = "vpc-0123456789abcdef0"
    control_plane_subnet_id = "subnet-0000000000000000a"
    worker_subnet_ids       = ["subnet-0000000000000000b"]
  }
  override_data {
    target = data.aws_subnet.worker
    values = {
      map_public_ip_on_launch = false
      vpc_id                  = "vpc-0000000000000000f"
    }
  }
  expect_failures = [aws_launch_template.worker]
}

run "existing_vpc_needs_its_own_control_plane_subnet" {
  command = plan
  variables {
    vpc_id                  = "vpc-0123456789abcdef0"
    control_plane_subnet_id = "subnet-0000000000000000a"
    worker_subnet_ids       = ["subnet-0000000000000000b"]
  }
  override_data {
    target = data.aws_subnet.control_plane
    values = {
      vpc_id = "vpc-0000000000000000f"
    }
  }
  expect_failures = [aws_instance.control_plane]
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
  expect_failures = [var.load_balancer_subnet_ids]
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

# What the region has, checked at plan against what it reads (the mocks above: us-east-1, its
# zones a-c, the listed types): a type it does not offer, a zone it does not have, a
# certificate of another region. Resources' preconditions, each refused in a run of its own.
run "a_type_the_region_does_not_offer" {
  command = plan
  variables {
    worker_instance_types = ["g4dn.xlarge", "g5.4xlarge"] # allowed, not offered (the mock)
  }
  expect_failures = [aws_launch_template.worker["g5.4xlarge"]]
}

run "a_zone_the_region_does_not_have" {
  command = plan
  variables {
    availability_zones = ["us-east-1a", "us-east-1z"]
  }
  expect_failures = [aws_vpc.this]
}

run "a_certificate_of_another_region" {
  command = plan
  variables {
    allow_plain_http    = false
    api_certificate_arn = "arn:aws:acm:eu-west-1:123456789012:certificate/0a1b2c3d-0000-4000-8000-00000000000f"
  }
  expect_failures = [aws_lb_listener.https]
}
