# heteroplane on AWS: the control-plane host, its IAM role, the security groups, a launch template
# per candidate worker instance type, the model bucket, a KMS key, and SQLite on an encrypted
# volume or PostgreSQL on RDS. The resources are split by concern: network.tf, kms.tf,
# bucket.tf, iam.tf, security_groups.tf, workers.tf, control_plane.tf, database.tf.

data "aws_region" "current" {}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

# A new VPC's zones: the region's first two, or var.availability_zones, checked against these at
# plan (network.tf).
data "aws_availability_zones" "available" {
  count = var.vpc_id == null ? 1 : 0
  state = "available"
}

locals {
  region     = data.aws_region.current.name
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  # The ARN prefix of this account's EC2 resources in this region.
  ec2_arn = "arn:${local.partition}:ec2:${local.region}:${local.account_id}"

  # The control plane's tag keys on AWS are "<name>:..." (its ec2.tag_prefix setting), so the
  # IAM conditions below and the provisioner agree on "<name>:managed".
  managed_tag = "${var.name}:managed"

  tags = merge({ Project = "heteroplane", Deployment = var.name }, var.tags)

  create_vpc = var.vpc_id == null
  zones = local.create_vpc ? (
    length(var.availability_zones) > 0 ? var.availability_zones : slice(data.aws_availability_zones.available[0].names, 0, 2)
  ) : []

  vpc_id            = local.create_vpc ? aws_vpc.this[0].id : var.vpc_id
  worker_subnet_ids = local.create_vpc ? aws_subnet.private[*].id : var.worker_subnet_ids
  # TLS (load_balancer.tf): with a certificate, an Application Load Balancer is the API's only
  # way in. It is internet-facing where the host would have had a public IP; the host itself
  # then gets none.
  tls                  = var.api_certificate_arn != null
  host_public_ip       = var.control_plane_public_ip && !local.tls
  load_balancer_public = var.control_plane_public_ip
  load_balancer_subnet_ids = local.create_vpc ? (
    local.load_balancer_public ? aws_subnet.public[*].id : aws_subnet.private[*].id
  ) : var.load_balancer_subnet_ids

  # Without a public IP the host sits in a private subnet of a new VPC (it reaches out through
  # the NAT gateway); with one, in a public subnet.
  control_plane_subnet_id = local.create_vpc ? (
    local.host_public_ip ? aws_subnet.public[0].id : aws_subnet.private[0].id
  ) : var.control_plane_subnet_id
  control_plane_zone = local.create_vpc ? local.zones[0] : data.aws_subnet.control_plane[0].availability_zone
  control_plane_address = (
    local.host_public_ip ? aws_eip.control_plane[0].public_ip : aws_instance.control_plane.private_ip
  )

  kms_key_arn = var.kms_key_arn != null ? var.kms_key_arn : aws_kms_key.this[0].arn

  model_bucket     = var.model_bucket_name != null ? var.model_bucket_name : aws_s3_bucket.models[0].id
  model_bucket_arn = "arn:${local.partition}:s3:::${local.model_bucket}"
  # Where the registry's artifacts live in it (models/<name>/<version>/<sha256>.<ext>); the
  # files directly under it are the demo family's, which workers copy at boot.
  registry_prefix = "models/"

  launch_templates = { for t in var.worker_instance_types : t => aws_launch_template.worker[t].id }

  # The control plane's settings (docs/service.md), as the environment of `heteroplane serve`.
  # The database URL is not among them: SQLite is the default file in the data directory (on
  # the encrypted volume), and the PostgreSQL URL is built on the host from the RDS-managed
  # secret at every start, so that no password is in the user data or in the state.
  service_environment = {
    HETEROPLANE_DATA_DIR               = "/var/lib/heteroplane"
    HETEROPLANE_HOST                   = "0.0.0.0"
    HETEROPLANE_PORT                   = tostring(var.api_port)
    HETEROPLANE_PROVISIONER            = "ec2"
    HETEROPLANE_EC2_REGION             = local.region
    HETEROPLANE_EC2_SUBNET_IDS         = join(",", local.worker_subnet_ids)
    HETEROPLANE_EC2_SECURITY_GROUP_IDS = aws_security_group.workers.id
    HETEROPLANE_EC2_LAUNCH_TEMPLATES   = join(",", [for t in var.worker_instance_types : "${t}=${local.launch_templates[t]}"])
    HETEROPLANE_EC2_TAG_PREFIX         = var.name
    # The model registry keeps the artifacts users push in the model bucket, under models/
    # (iam.tf: the control plane writes there, the workers read).
    HETEROPLANE_EC2_MODEL_BUCKET = local.model_bucket
    HETEROPLANE_EC2_MODEL_PREFIX = local.registry_prefix
    # Spot interruption notices (interruptions.tf; provisioners/spot.py).
    HETEROPLANE_EC2_INTERRUPTION_QUEUE_URL = aws_sqs_queue.interruptions.url
  }
  # Behind the load balancer: the dashboard's cookie is Secure, and uvicorn takes the scheme
  # and client address from the load balancer's X-Forwarded-* headers ("*": the host's API
  # port admits the load balancer's group alone, security_groups.tf).
  tls_environment = local.tls ? {
    HETEROPLANE_DASHBOARD_SECURE_COOKIE = "true"
    FORWARDED_ALLOW_IPS                 = "*"
  } : {}
  control_plane_environment = merge(local.service_environment, local.tls_environment)

  # What a new app gets unless its spec says otherwise (the service has no such settings yet:
  # the host keeps them in /etc/heteroplane/app-defaults.yaml, a starting point for specs).
  app_defaults = {
    budget_usd_per_hr = var.default_budget_usd_per_hr
    slo = {
      latency_ms = var.default_slo_latency_ms
      percentile = var.default_slo_percentile
    }
    instance_types = var.worker_instance_types
  }
}
