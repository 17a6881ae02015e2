# The control-plane host: heteroplane installed from its repository, `heteroplane serve` under
# systemd with the settings below, the API on var.api_port; SQLite on an encrypted volume of its
# own (kept when the host is replaced) unless the database is PostgreSQL. Its admin token is
# minted on the host at first start and stored in the SSM parameter below: terraform writes only
# a placeholder there (write-only, so not even that is in the state), and never reads it back.

locals {
  sqlite = var.database == "sqlite"

  control_plane_user_data = templatefile("${path.module}/templates/control-plane.sh.tftpl", {
    install               = local.install_script
    environment           = local.control_plane_environment
    region                = local.region
    admin_token_parameter = aws_ssm_parameter.admin_token.name
    kms_key_arn           = local.kms_key_arn
    data_volume_id        = local.sqlite ? aws_ebs_volume.data[0].id : ""
    database_secret_arn   = local.sqlite ? "" : aws_db_instance.this[0].master_user_secret[0].secret_arn
    database_host         = local.sqlite ? "" : aws_db_instance.this[0].address
    database_port         = local.sqlite ? "" : tostring(aws_db_instance.this[0].port)
    database_name         = local.sqlite ? "" : aws_db_instance.this[0].db_name
    app_defaults          = yamlencode(local.app_defaults)
    admin_token_py        = file("${path.module}/templates/admin_token.py")
    database_url_py       = file("${path.module}/templates/database_url.py")
  })
}

resource "aws_instance" "control_plane" {
  ami                         = coalesce(var.control_plane_ami_id, var.worker_ami_id)
  instance_type               = var.control_plane_instance_type
  subnet_id                   = local.control_plane_subnet_id
  vpc_security_group_ids      = [aws_security_group.control_plane.id]
  iam_instance_profile        = aws_iam_instance_profile.control_plane.name
  monitoring                  = var.detailed_monitoring
  ebs_optimized               = true
  user_data                   = local.control_plane_user_data
  user_data_replace_on_change = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  root_block_device {
    encrypted   = true
    kms_key_id  = local.kms_key_arn
    volume_type = "gp3"
    volume_size = 30
  }

  tags = merge(local.tags, { Name = "${var.name}-control-plane" })

  lifecycle {
    # Its security group is created in vpc_id: a subnet of another VPC cannot take it.
    precondition {
      condition     = local.create_vpc || try(data.aws_subnet.control_plane[0].vpc_id == var.vpc_id, true)
      error_message = "control_plane_subnet_id must be a subnet of vpc_id: ${try("${data.aws_subnet.control_plane[0].id} is in ${data.aws_subnet.control_plane[0].vpc_id}", "")}."
    }
  }
}

# With control_plane_public_ip and no certificate (with one, the load balancer is the way in):
# an Elastic IP, so that the API URL stays when the host is replaced (its user data changed,
# say). The host waits for its way out before it installs.
resource "aws_eip" "control_plane" {
  count = local.host_public_ip ? 1 : 0

  domain   = "vpc"
  instance = aws_instance.control_plane.id
  tags     = merge(local.tags, { Name = "${var.name}-control-plane" })

  depends_on = [aws_internet_gateway.this]
}

resource "aws_ebs_volume" "data" {
  count = local.sqlite ? 1 : 0

  availability_zone = local.control_plane_zone
  size              = var.sqlite_volume_size_gib
  type              = "gp3"
  encrypted         = true
  kms_key_id        = local.kms_key_arn

  tags = merge(local.tags, { Name = "${var.name}-data" })
}

resource "aws_volume_attachment" "data" {
  count = local.sqlite ? 1 : 0

  device_name = "/dev/sdf"
  volume_id   = aws_ebs_volume.data[0].id
  instance_id = aws_instance.control_plane.id
  # SQLite is on it: stop the host before the volume is taken away.
  stop_instance_before_detaching = true
}

resource "aws_ssm_parameter" "admin_token" {
  name        = "/${var.name}/admin-token"
  description = "heteroplane ${var.name}: the admin API token, written by the control-plane host at its first start"
  type        = "SecureString"
  key_id      = local.kms_key_arn
  # A placeholder the host replaces; write-only, so terraform keeps no value of it in the state.
  value_wo         = "pending: the control plane stores its admin token here when it first starts"
  value_wo_version = 1

  tags = local.tags
}
