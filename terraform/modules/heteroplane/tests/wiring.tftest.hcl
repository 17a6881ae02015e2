# How the module's parts are wired, with a mock AWS provider (apply creates nothing: the mock
# makes up ids, so references between resources can be compared).

mock_provider "aws" {
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
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\": \"2012-10-17\", \"Statement\": []}"
    }
  }
  mock_data "aws_region" {
    defaults = {
      name = "us-east-1"
    }
  }
  mock_data "aws_partition" {
    defaults = {
      partition = "aws"
    }
  }
  mock_data "aws_caller_identity" {
    defaults = {
      account_id = "123456789012"
    }
  }
  mock_data "aws_ami" {
    defaults = {
      root_device_name = "/dev/xvda"
    }
  }
  mock_resource "aws_iam_instance_profile" {
    defaults = {
      arn = "arn:aws:iam::123456789012:instance-profile/heteroplane-worker"
    }
  }
  mock_resource "aws_iam_role" {
    defaults = {
      arn = "arn:aws:iam::123456789012:role/heteroplane-worker"
    }
  }
  mock_resource "aws_db_instance" {
    defaults = {
      master_user_secret = [{
        secret_arn    = "arn:aws:secretsmanager:us-east-1:123456789012:secret:rds!db-0000"
        kms_key_id    = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
        secret_status = "active"
      }]
    }
  }
  mock_resource "aws_lb" {
    defaults = {
      arn      = "arn:aws:elasticloadbalancing:us-east-1:123456789012:loadbalancer/app/heteroplane-api/0123456789abcdef"
      dns_name = "heteroplane-api-0123456789.us-east-1.elb.amazonaws.com"
    }
  }
  mock_resource "aws_lb_target_group" {
    defaults = {
      arn = "arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/heteroplane-api/0123456789abcdef"
    }
  }
  mock_resource "aws_sqs_queue" {
    defaults = {
      arn = "arn:aws:sqs:us-east-1:123456789012:heteroplane-interruptions"
      url = "https://sqs.us-east-1.amazonaws.com/123456789012/heteroplane-interruptions"
    }
  }
  mock_resource "aws_cloudwatch_event_rule" {
    defaults = {
      arn = "arn:aws:events:us-east-1:123456789012:rule/heteroplane-interruption"
    }
  }
  mock_resource "aws_kms_key" {
    defaults = {
      arn = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
    }
  }
}

# An existing VPC's subnets are in that VPC (a run may say otherwise).
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
    vpc_id = "vpc-0123456789abcdef0"
  }
}

variables {
  api_allowed_cidr      = "198.51.100.0/24"
  worker_ami_id         = "ami-0123456789abcdef0"
  heteroplane_git_url   = "https://example.com/heteroplane.git"
  availability_zones    = ["us-east-1a", "us-east-1b"]
  worker_instance_types = ["g4dn.xlarge", "c5n.2xlarge", "r5n.large"]
  allow_plain_http      = true
}

# The deployment with the file's variables (SQLite, a new VPC, no certificate), every part
# checked in one apply: a run costs a plan and an apply with the provider's schema loaded
# again (about 3 s of CPU).
run "the_default_deployment" {
  # a launch template per candidate type
  assert {
    condition     = toset(keys(aws_launch_template.worker)) == toset(var.worker_instance_types)
    error_message = "every candidate type needs a launch template, and no other type one"
  }
  assert {
    condition     = alltrue([for t, lt in aws_launch_template.worker : lt.instance_type == t && lt.name == "heteroplane-${t}"])
    error_message = "a template launches its own type and is named <name>-<type>"
  }
  assert {
    condition     = alltrue([for t, lt in aws_launch_template.worker : strcontains(base64decode(lt.user_data), "--instance-type ${t} ")])
    error_message = "each template's user data starts the worker agent for its type"
  }
  assert {
    condition     = alltrue([for lt in aws_launch_template.worker : strcontains(base64decode(lt.user_data), "python -m provisioners.worker --host 0.0.0.0 --port 8080")])
    error_message = "the worker agent listens on the worker port"
  }
  assert {
    condition     = alltrue([for lt in aws_launch_template.worker : lt.metadata_options[0].http_tokens == "required"])
    error_message = "IMDSv2 must be required on workers"
  }
  assert {
    condition     = alltrue([for lt in aws_launch_template.worker : lt.block_device_mappings[0].ebs[0].encrypted == "true" && lt.block_device_mappings[0].device_name == "/dev/xvda"])
    error_message = "the workers' root volumes must be encrypted"
  }
  assert {
    condition     = alltrue([for lt in aws_launch_template.worker : lt.vpc_security_group_ids == toset([aws_security_group.workers.id]) && length(lt.network_interfaces) == 0])
    error_message = "workers get the workers' security group, and no network interface of the template's (so no public IP)"
  }
  assert {
    condition     = alltrue([for lt in aws_launch_template.worker : lt.iam_instance_profile[0].arn == aws_iam_instance_profile.worker.arn])
    error_message = "workers run with the worker role"
  }
  assert {
    condition     = alltrue([for lt in aws_launch_template.worker : lt.tags["heteroplane:managed"] == "true"])
    error_message = "the control plane may launch only from templates tagged managed"
  }

  # security groups
  assert {
    condition     = aws_security_group_rule.api.type == "ingress" && aws_security_group_rule.api.cidr_blocks == tolist(["198.51.100.0/24"]) && aws_security_group_rule.api.from_port == 8000 && aws_security_group_rule.api.to_port == 8000
    error_message = "the API is open to the allowed CIDR on its port, and only that"
  }
  assert {
    condition     = aws_security_group_rule.api.security_group_id == aws_security_group.control_plane.id
    error_message = "the API rule belongs to the control plane's group"
  }
  assert {
    condition     = aws_security_group_rule.worker_agent.type == "ingress" && aws_security_group_rule.worker_agent.source_security_group_id == aws_security_group.control_plane.id && aws_security_group_rule.worker_agent.cidr_blocks == null
    error_message = "workers admit the control plane's group only"
  }
  assert {
    condition     = aws_security_group_rule.worker_agent.security_group_id == aws_security_group.workers.id && aws_security_group_rule.worker_agent.from_port == 8080
    error_message = "the workers' rule is the agent port on the workers' group"
  }
  assert {
    condition     = length([for r in [aws_security_group_rule.worker_agent, aws_security_group_rule.api] : r if r.type == "ingress"]) == 2 && length(aws_security_group.database) == 0
    error_message = "two ingress rules with SQLite: the API and the workers' agent"
  }
  assert {
    condition     = aws_instance.control_plane.vpc_security_group_ids == toset([aws_security_group.control_plane.id])
    error_message = "the control plane has its own group only"
  }

  # control plane settings come from the resources
  assert {
    condition     = output.control_plane_environment["HETEROPLANE_EC2_LAUNCH_TEMPLATES"] == join(",", [for t in var.worker_instance_types : "${t}=${aws_launch_template.worker[t].id}"])
    error_message = "the provisioner's launch templates are terraform's, by type"
  }
  assert {
    condition     = output.control_plane_environment["HETEROPLANE_EC2_SUBNET_IDS"] == join(",", aws_subnet.private[*].id)
    error_message = "workers launch into the private subnets"
  }
  assert {
    condition     = output.control_plane_environment["HETEROPLANE_EC2_SECURITY_GROUP_IDS"] == aws_security_group.workers.id
    error_message = "workers launch with the workers' group"
  }
  assert {
    condition     = output.control_plane_environment["HETEROPLANE_PROVISIONER"] == "ec2" && output.control_plane_environment["HETEROPLANE_EC2_TAG_PREFIX"] == "heteroplane"
    error_message = "the service runs the EC2 provisioner with the deployment's tag prefix"
  }
  assert {
    condition     = output.control_plane_environment["HETEROPLANE_EC2_MODEL_BUCKET"] == aws_s3_bucket.models[0].id && output.control_plane_environment["HETEROPLANE_EC2_MODEL_PREFIX"] == "models/" && output.model_bucket == aws_s3_bucket.models[0].id
    error_message = "the model registry stores its artifacts in the model bucket, under models/"
  }
  assert {
    condition     = alltrue([for k, v in output.control_plane_environment : strcontains(aws_instance.control_plane.user_data, "${k}=${v}\n")])
    error_message = "the host's settings file holds every setting"
  }
  assert {
    condition     = strcontains(aws_instance.control_plane.user_data, "ExecStart=/opt/heteroplane/bin/heteroplane-start") && strcontains(aws_instance.control_plane.user_data, "heteroplane db upgrade") && strcontains(aws_instance.control_plane.user_data, "exec /opt/heteroplane/venv/bin/heteroplane serve")
    error_message = "the host migrates and serves under systemd"
  }
  assert {
    condition     = output.launch_templates == { for t, lt in aws_launch_template.worker : t => lt.id }
    error_message = "the launch_templates output maps each type to its template"
  }
  assert {
    condition     = output.api_url == "http://${aws_eip.control_plane[0].public_ip}:8000" && aws_eip.control_plane[0].instance == aws_instance.control_plane.id
    error_message = "the API URL is the Elastic IP's, on the host"
  }

  # control plane host
  assert {
    condition     = aws_instance.control_plane.metadata_options[0].http_tokens == "required" && aws_instance.control_plane.root_block_device[0].encrypted
    error_message = "IMDSv2 and an encrypted root volume on the control plane"
  }
  assert {
    condition     = aws_instance.control_plane.iam_instance_profile == aws_iam_instance_profile.control_plane.name
    error_message = "the control plane runs with its own role"
  }
  assert {
    condition     = aws_ebs_volume.data[0].encrypted && aws_volume_attachment.data[0].instance_id == aws_instance.control_plane.id
    error_message = "SQLite lives on an encrypted volume attached to the host"
  }
  assert {
    condition     = strcontains(aws_instance.control_plane.user_data, replace(aws_ebs_volume.data[0].id, "-", ""))
    error_message = "the host mounts its data volume by id"
  }
  assert {
    condition     = aws_ssm_parameter.admin_token.type == "SecureString" && output.admin_token_ssm_parameter == "/heteroplane/admin-token"
    error_message = "the admin token's place is a SecureString parameter"
  }
  assert {
    condition     = output.app_defaults.budget_usd_per_hr == 10 && output.app_defaults.slo.latency_ms == 350 && output.app_defaults.slo.percentile == 99
    error_message = "the app defaults carry the budget and the SLO"
  }
  assert {
    condition     = length(aws_db_instance.this) == 0 && length(aws_nat_gateway.this) == 1 && length(aws_subnet.private) == 2
    error_message = "SQLite: no RDS; a new VPC with two zones and a NAT gateway"
  }

  # without a certificate no load balancer
  assert {
    condition     = length(aws_lb.api) == 0 && length(aws_security_group.load_balancer) == 0 && output.load_balancer_dns_name == null
    error_message = "no certificate: no load balancer"
  }
  assert {
    condition     = !contains(keys(output.control_plane_environment), "HETEROPLANE_DASHBOARD_SECURE_COOKIE")
    error_message = "no certificate: the cookie goes Secure only on an HTTPS request"
  }

  # interruption notices reach the queue
  assert {
    condition = toset([for r in aws_cloudwatch_event_rule.interruptions : jsondecode(r.event_pattern)["detail-type"][0]]) == toset([
      "EC2 Spot Instance Interruption Warning",
      "EC2 Instance Rebalance Recommendation",
      "EC2 Instance State-change Notification",
    ])
    error_message = "one rule per notice Karpenter takes: interruption warning, rebalance, state change"
  }
  assert {
    condition     = alltrue([for t in aws_cloudwatch_event_target.interruptions : t.arn == aws_sqs_queue.interruptions.arn])
    error_message = "every rule sends to the interruption queue"
  }
  assert {
    condition     = aws_sqs_queue.interruptions.sqs_managed_sse_enabled && aws_sqs_queue.interruptions.message_retention_seconds == 300
    error_message = "the queue is encrypted and keeps a notice no longer than it is of use"
  }
  assert {
    condition     = local.service_environment["HETEROPLANE_EC2_INTERRUPTION_QUEUE_URL"] == aws_sqs_queue.interruptions.url
    error_message = "the control plane reads the queue the rules fill"
  }
}

run "postgresql" {
  variables {
    database = "postgresql"
  }
  assert {
    condition     = aws_db_instance.this[0].storage_encrypted && aws_db_instance.this[0].manage_master_user_password && !aws_db_instance.this[0].publicly_accessible
    error_message = "RDS is encrypted, private, and its password is managed by RDS"
  }
  assert {
    condition     = aws_db_instance.this[0].vpc_security_group_ids == toset([aws_security_group.database[0].id])
    error_message = "RDS has the database group"
  }
  assert {
    condition     = aws_security_group_rule.database[0].source_security_group_id == aws_security_group.control_plane.id && aws_security_group_rule.database[0].from_port == 5432
    error_message = "PostgreSQL admits the control plane only"
  }
  assert {
    condition     = length(aws_ebs_volume.data) == 0 && strcontains(aws_instance.control_plane.user_data, "HP_DATABASE_SECRET_ARN=${aws_db_instance.this[0].master_user_secret[0].secret_arn}")
    error_message = "no SQLite volume; the host builds its URL from the RDS-managed secret"
  }
}

run "existing_vpc" {
  variables {
    vpc_id                  = "vpc-0123456789abcdef0"
    control_plane_subnet_id = "subnet-0000000000000000a"
    worker_subnet_ids       = ["subnet-0000000000000000b", "subnet-0000000000000000c"]
    control_plane_public_ip = false
  }
  override_data {
    target = data.aws_subnet.worker
    values = {
      map_public_ip_on_launch = false
      vpc_id                  = "vpc-0123456789abcdef0"
    }
  }
  assert {
    condition     = length(aws_vpc.this) == 0 && length(aws_subnet.private) == 0 && length(aws_nat_gateway.this) == 0
    error_message = "an existing VPC: no network is created"
  }
  assert {
    condition     = output.worker_subnet_ids == tolist(["subnet-0000000000000000b", "subnet-0000000000000000c"]) && aws_instance.control_plane.subnet_id == "subnet-0000000000000000a"
    error_message = "the given subnets are used"
  }
  assert {
    condition     = aws_security_group.workers.vpc_id == "vpc-0123456789abcdef0"
    error_message = "the groups are in the given VPC"
  }
  assert {
    condition     = length(aws_eip.control_plane) == 0 && output.api_url == "http://${aws_instance.control_plane.private_ip}:8000"
    error_message = "without a public IP the API URL is the private address"
  }
}

run "public_worker_subnets_are_refused" {
  command = plan
  variables {
    vpc_id                  = "vpc-0123456789abcdef0"
    control_plane_subnet_id = "subnet-0000000000000000a"
    worker_subnet_ids       = ["subnet-0000000000000000b"]
  }
  override_data {
    target = data.aws_subnet.worker
    values = {
      map_public_ip_on_launch = true
    }
  }
  expect_failures = [aws_launch_template.worker]
}

run "the_role_launches_allowed_types_with_heteroplanes_tags" {
  command = plan
  variables {
    allowed_instance_types = ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.large"]
  }
  assert {
    condition = toset([
      for c in one([for s in data.aws_iam_policy_document.control_plane_provisioner.statement : s if s.sid == "LaunchTaggedInstances"]).condition :
      "${c.test} ${c.variable} = ${join(",", c.values)}"
      ]) == toset([
      "StringEquals ec2:InstanceType = g4dn.xlarge,c5n.2xlarge,r5n.large,t3.large",
      "StringEquals aws:RequestTag/heteroplane:managed = true",
      "Null aws:RequestTag/heteroplane:app = false",
      "Null aws:RequestTag/heteroplane:request-id = false",
    ])
    error_message = "RunInstances on instances: only the allowed types, only with heteroplane's request tags"
  }
}

run "tls_through_a_load_balancer" {
  variables {
    api_certificate_arn = "arn:aws:acm:us-east-1:123456789012:certificate/0a1b2c3d-0000-4000-8000-00000000000f"
    api_domain_name     = "api.example.com"
    allow_plain_http    = false
  }
  assert {
    condition     = length(aws_lb.api) == 1 && !aws_lb.api[0].internal && aws_lb.api[0].load_balancer_type == "application" && aws_lb.api[0].drop_invalid_header_fields
    error_message = "an internet-facing Application Load Balancer that drops invalid headers"
  }
  assert {
    condition     = toset(aws_lb.api[0].subnets) == toset(aws_subnet.public[*].id) && aws_lb.api[0].security_groups == toset([aws_security_group.load_balancer[0].id])
    error_message = "the load balancer sits in the public subnets, with its own group"
  }
  assert {
    condition     = aws_lb_listener.https[0].port == 443 && aws_lb_listener.https[0].protocol == "HTTPS" && aws_lb_listener.https[0].certificate_arn == var.api_certificate_arn && aws_lb_listener.https[0].ssl_policy == "ELBSecurityPolicy-TLS13-1-2-2021-06"
    error_message = "HTTPS on 443 with the user's certificate and TLS 1.2+ only"
  }
  assert {
    condition     = aws_lb_listener.https[0].default_action[0].target_group_arn == aws_lb_target_group.api[0].arn && aws_lb_target_group.api[0].port == 8000 && aws_lb_target_group.api[0].health_check[0].path == "/healthz"
    error_message = "HTTPS forwards to the API port, checked on /healthz"
  }
  assert {
    condition     = aws_lb_target_group_attachment.api[0].target_id == aws_instance.control_plane.id
    error_message = "the host is the load balancer's target"
  }
  assert {
    condition     = aws_lb_listener.http[0].port == 80 && aws_lb_listener.http[0].default_action[0].type == "redirect" && aws_lb_listener.http[0].default_action[0].redirect[0].protocol == "HTTPS" && aws_lb_listener.http[0].default_action[0].redirect[0].port == "443"
    error_message = "plain HTTP is answered with a redirect to HTTPS"
  }
  assert {
    condition     = aws_security_group_rule.api.source_security_group_id == aws_security_group.load_balancer[0].id && aws_security_group_rule.api.cidr_blocks == null
    error_message = "the host's API port admits the load balancer alone"
  }
  assert {
    condition     = aws_security_group_rule.load_balancer_https[0].cidr_blocks == tolist(["198.51.100.0/24"]) && aws_security_group_rule.load_balancer_http[0].cidr_blocks == tolist(["198.51.100.0/24"]) && aws_security_group_rule.load_balancer_to_api[0].source_security_group_id == aws_security_group.control_plane.id
    error_message = "the load balancer admits the allowed CIDR, and reaches only the host's API port"
  }
  assert {
    condition     = length(aws_eip.control_plane) == 0 && aws_instance.control_plane.subnet_id == aws_subnet.private[0].id
    error_message = "behind the load balancer the host has no public IP"
  }
  assert {
    condition     = output.api_url == "https://api.example.com" && output.load_balancer_dns_name == aws_lb.api[0].dns_name
    error_message = "the API URL is HTTPS on the certificate's name"
  }
  assert {
    condition     = output.control_plane_environment["HETEROPLANE_DASHBOARD_SECURE_COOKIE"] == "true" && output.control_plane_environment["FORWARDED_ALLOW_IPS"] == "*" && strcontains(aws_instance.control_plane.user_data, "HETEROPLANE_DASHBOARD_SECURE_COOKIE=true\n")
    error_message = "behind TLS the dashboard cookie is Secure and the forwarded scheme is trusted"
  }
}

run "an_internal_load_balancer_without_a_public_ip" {
  command = plan
  variables {
    api_certificate_arn     = "arn:aws:acm:us-east-1:123456789012:certificate/0a1b2c3d-0000-4000-8000-00000000000f"
    control_plane_public_ip = false
  }
  assert {
    condition     = aws_lb.api[0].internal
    error_message = "control_plane_public_ip = false: an internal load balancer"
  }
}
