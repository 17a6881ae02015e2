# A launch template per candidate worker instance type, named "<name>-<type>" (the name the
# provisioner's development path would look for): the worker AMI, the worker role, the workers'
# security group, IMDSv2 only, an encrypted root volume, and user data that installs and starts
# the worker agent for that type. No public IP: workers launch into private subnets (a new VPC's,
# or var.worker_subnet_ids, checked below). The network stays out of the template because the
# provisioner passes SubnetId and SecurityGroupIds to RunInstances, which EC2 refuses alongside
# a template's network interface.

data "aws_ami" "worker" {
  filter {
    name   = "image-id"
    values = [var.worker_ami_id]
  }
}

# The candidate types this region offers: a misspelt type, or one the region lacks, is refused
# at plan (the launch template below) rather than when a worker first fails to launch.
data "aws_ec2_instance_type_offerings" "workers" {
  location_type = "region"

  filter {
    name   = "instance-type"
    values = var.worker_instance_types
  }
}

locals {
  install_script = templatefile("${path.module}/templates/install.sh.tftpl", {
    git_url = var.heteroplane_git_url
    git_ref = var.heteroplane_git_ref
  })
}

resource "aws_launch_template" "worker" {
  for_each = toset(var.worker_instance_types)

  name                   = "${var.name}-${each.key}"
  description            = "heteroplane worker: ${each.key}"
  image_id               = var.worker_ami_id
  instance_type          = each.key
  update_default_version = true
  vpc_security_group_ids = [aws_security_group.workers.id]

  user_data = base64encode(templatefile("${path.module}/templates/worker.sh.tftpl", {
    install       = local.install_script
    name          = var.name
    instance_type = each.key
    worker_port   = var.worker_port
    model_bucket  = local.model_bucket
    region        = local.region
  }))

  iam_instance_profile {
    arn = aws_iam_instance_profile.worker.arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  monitoring {
    enabled = var.detailed_monitoring
  }

  block_device_mappings {
    device_name = data.aws_ami.worker.root_device_name

    ebs {
      encrypted             = true
      kms_key_id            = local.kms_key_arn
      volume_size           = var.worker_volume_size_gib
      volume_type           = "gp3"
      delete_on_termination = true
    }
  }

  # The provisioner's IAM role may launch only from templates tagged managed (iam.tf).
  tags = merge(local.tags, { Name = "${var.name}-${each.key}", (local.managed_tag) = "true" })

  lifecycle {
    # The template sets no tag specifications of its own (the provisioner tags what it
    # launches); moto copies the template's tags into them, which is all this would see.
    ignore_changes = [tag_specifications]

    precondition {
      condition     = contains(data.aws_ec2_instance_type_offerings.workers.instance_types, each.key)
      error_message = "worker_instance_types: ${each.key} is not an instance type ${local.region} offers (misspelt, or not in this region)."
    }

    precondition {
      condition     = alltrue([for s in data.aws_subnet.worker : !s.map_public_ip_on_launch])
      error_message = "worker_subnet_ids must be private subnets: one of them assigns public IPs on launch (map_public_ip_on_launch)."
    }

    # The role may launch into vpc_id only (iam.tf), and the workers' security group is there.
    precondition {
      condition     = alltrue([for s in data.aws_subnet.worker : s.vpc_id == var.vpc_id])
      error_message = "worker_subnet_ids must be subnets of vpc_id: ${join(", ", [for s in data.aws_subnet.worker : "${s.id} is in ${s.vpc_id}" if s.vpc_id != var.vpc_id])}."
    }
  }
}
