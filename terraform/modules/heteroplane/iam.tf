# Two roles.
#
# The control plane's: exactly the EC2 calls provisioners/ec2.py makes (RunInstances with tags,
# DescribeInstances, DescribeSubnets, TerminateInstances, CreateFleet for spot,
# DescribeLaunchTemplates / CreateLaunchTemplate for the development path, and
# DescribeLaunchTemplateVersions: a template's user data, for workers serving a user's models),
# scoped by the "<name>:managed" tag wherever EC2 takes a tag condition, to the instance types
# the deployment allows (var.allowed_instance_types) and heteroplane's request tags, to this
# VPC's subnets and groups, to the worker AMI and to this region and account; iam:PassRole for
# the worker role alone; what its boot needs (the admin token's parameter, the database secret);
# and the model registry's objects, under models/ in the model bucket. Describe* calls take no
# resource-level permission, so their Resource is "*" (the actions are still named one by one:
# no wildcard action anywhere). tests/unit/test_terraform_hcl.py checks the actions against the
# provisioner's code.
#
# The workers': read the model bucket, nothing else.

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# --- the control plane --------------------------------------------------------------------------

resource "aws_iam_role" "control_plane" {
  name               = "${var.name}-control-plane"
  description        = "heteroplane control plane: launches and terminates its workers"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

resource "aws_iam_instance_profile" "control_plane" {
  name = "${var.name}-control-plane"
  role = aws_iam_role.control_plane.name
  tags = local.tags
}

resource "aws_iam_role_policy" "control_plane_provisioner" {
  name   = "provisioner"
  role   = aws_iam_role.control_plane.id
  policy = data.aws_iam_policy_document.control_plane_provisioner.json
}

resource "aws_iam_role_policy" "control_plane_registry" {
  name   = "model-registry"
  role   = aws_iam_role.control_plane.id
  policy = data.aws_iam_policy_document.control_plane_registry.json
}

resource "aws_iam_role_policy" "control_plane_bootstrap" {
  name   = "bootstrap"
  role   = aws_iam_role.control_plane.id
  policy = data.aws_iam_policy_document.control_plane_bootstrap.json
}

data "aws_iam_policy_document" "control_plane_provisioner" {
  # Listing (by tag filters), the subnets' zones, finding a template, spot prices
  # (provisioners/spot.py): EC2's Describe* calls support no resource-level permissions.
  statement {
    sid = "Describe"
    actions = [
      "ec2:DescribeInstances",
      "ec2:DescribeLaunchTemplates",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:DescribeSpotPriceHistory",
      "ec2:DescribeSubnets",
    ]
    resources = ["*"]
  }

  # The instances it launches must be of a type the deployment allows (var.allowed_instance_types,
  # by default heteroplane's catalog: a bug or a stolen role cannot start a p5.48xlarge), and
  # carry heteroplane's tags in the request (RunInstances' and CreateFleet's
  # TagSpecifications): <name>:managed=true, and the app and the request id the provisioner
  # sets on every launch (provisioners/base.py launch_tags; the reconciler names the app).
  statement {
    sid       = "LaunchTaggedInstances"
    actions   = ["ec2:RunInstances"]
    resources = ["${local.ec2_arn}:instance/*"]
    condition {
      test     = "StringEquals"
      variable = "ec2:InstanceType"
      values   = var.allowed_instance_types
    }
    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/${local.managed_tag}"
      values   = ["true"]
    }
    condition {
      test     = "Null"
      variable = "aws:RequestTag/${var.name}:app"
      values   = ["false"]
    }
    condition {
      test     = "Null"
      variable = "aws:RequestTag/${var.name}:request-id"
      values   = ["false"]
    }
  }

  # Volumes are created with the instance and tagged with it (RunInstances and instant
  # CreateFleet both tag them); no tag condition here, so that a launch does not hinge on the
  # volume tags (the volumes are encrypted with the deployment's key, below).
  statement {
    sid       = "LaunchVolumes"
    actions   = ["ec2:RunInstances"]
    resources = ["${local.ec2_arn}:volume/*"]
  }

  # Only into this VPC's subnets, with its security groups.
  statement {
    sid     = "LaunchIntoThisVpc"
    actions = ["ec2:RunInstances", "ec2:CreateFleet"]
    resources = [
      "${local.ec2_arn}:subnet/*",
      "${local.ec2_arn}:security-group/*",
      "${local.ec2_arn}:network-interface/*",
    ]
    condition {
      test     = "ArnEquals"
      variable = "ec2:Vpc"
      values   = ["${local.ec2_arn}:vpc/${local.vpc_id}"]
    }
  }

  # Only the worker AMI (and the snapshots behind it).
  statement {
    sid     = "LaunchTheWorkerImage"
    actions = ["ec2:RunInstances"]
    resources = [
      "arn:${local.partition}:ec2:${local.region}::image/${var.worker_ami_id}",
      "arn:${local.partition}:ec2:${local.region}::snapshot/*",
    ]
  }

  # Only from this deployment's launch templates (tagged <name>:managed=true).
  statement {
    sid       = "LaunchFromManagedTemplates"
    actions   = ["ec2:RunInstances", "ec2:CreateFleet"]
    resources = ["${local.ec2_arn}:launch-template/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/${local.managed_tag}"
      values   = ["true"]
    }
  }

  # Spot: an instant fleet (the request itself; the fleet is not tagged).
  statement {
    sid       = "SpotFleet"
    actions   = ["ec2:CreateFleet"]
    resources = ["${local.ec2_arn}:fleet/*"]
  }

  # Tags only as part of creating an instance, its volumes or a template: never on anything
  # that exists.
  statement {
    sid       = "TagOnLaunch"
    actions   = ["ec2:CreateTags"]
    resources = ["${local.ec2_arn}:instance/*", "${local.ec2_arn}:volume/*"]
    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["RunInstances", "CreateFleet"]
    }
  }

  statement {
    sid       = "TagNewTemplates"
    actions   = ["ec2:CreateTags"]
    resources = ["${local.ec2_arn}:launch-template/*"]
    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["CreateLaunchTemplate"]
    }
  }

  # Terminate only what it manages.
  statement {
    sid       = "TerminateManaged"
    actions   = ["ec2:TerminateInstances"]
    resources = ["${local.ec2_arn}:instance/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/${local.managed_tag}"
      values   = ["true"]
    }
  }

  # The development path (ensure_launch_templates): templates it creates are tagged managed.
  statement {
    sid       = "CreateManagedTemplates"
    actions   = ["ec2:CreateLaunchTemplate"]
    resources = ["${local.ec2_arn}:launch-template/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/${local.managed_tag}"
      values   = ["true"]
    }
  }

  # Workers run as the worker role, and only as that role, and only on EC2.
  statement {
    sid       = "PassTheWorkerRole"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.worker.arn]
    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["ec2.amazonaws.com"]
    }
  }

  # The workers' volumes are encrypted with the deployment's key: launching them needs its use
  # through EC2 (a grant for the volume).
  statement {
    sid = "EncryptWorkerVolumes"
    actions = [
      "kms:Decrypt",
      "kms:DescribeKey",
      "kms:GenerateDataKeyWithoutPlaintext",
      "kms:ReEncryptFrom",
      "kms:ReEncryptTo",
    ]
    resources = [local.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["ec2.${local.region}.amazonaws.com"]
    }
  }

  statement {
    sid       = "GrantForWorkerVolumes"
    actions   = ["kms:CreateGrant"]
    resources = [local.kms_key_arn]
    condition {
      test     = "Bool"
      variable = "kms:GrantIsForAWSResource"
      values   = ["true"]
    }
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["ec2.${local.region}.amazonaws.com"]
    }
  }
}

# The model registry (controlplane/registry): the artifacts users push are stored, read back
# (GET /v1/models/.../artifact) and removed (a push that fails half way) under models/ in the
# model bucket, encrypted with the deployment's key; nothing else in the bucket.
data "aws_iam_policy_document" "control_plane_registry" {
  statement {
    sid       = "RegistryObjects"
    actions   = ["s3:PutObject", "s3:GetObject", "s3:DeleteObject"]
    resources = ["${local.model_bucket_arn}/${local.registry_prefix}*"]
  }

  # Listing only under models/ (and a missing object answers 404 rather than 403).
  statement {
    sid       = "ListRegistry"
    actions   = ["s3:ListBucket"]
    resources = [local.model_bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${local.registry_prefix}*"]
    }
  }

  statement {
    sid       = "RegistryEncryption"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [local.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${local.region}.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "control_plane_bootstrap" {
  # The host mints the admin token on its first start and keeps it in this parameter.
  statement {
    sid       = "AdminTokenParameter"
    actions   = ["ssm:GetParameter", "ssm:PutParameter"]
    resources = [aws_ssm_parameter.admin_token.arn]
  }

  statement {
    sid       = "AdminTokenAndSecretEncryption"
    actions   = ["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"]
    resources = [local.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["ssm.${local.region}.amazonaws.com", "secretsmanager.${local.region}.amazonaws.com"]
    }
  }

  # PostgreSQL: the RDS-managed master secret, read at every start to build the database URL.
  dynamic "statement" {
    for_each = var.database == "postgresql" ? [1] : []
    content {
      sid       = "DatabaseSecret"
      actions   = ["secretsmanager:GetSecretValue"]
      resources = [aws_db_instance.this[0].master_user_secret[0].secret_arn]
    }
  }
}

# --- the workers --------------------------------------------------------------------------------

resource "aws_iam_role" "worker" {
  name               = "${var.name}-worker"
  description        = "heteroplane worker: reads the model bucket"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

resource "aws_iam_instance_profile" "worker" {
  name = "${var.name}-worker"
  role = aws_iam_role.worker.name
  tags = local.tags
}

resource "aws_iam_role_policy" "worker_models" {
  name   = "read-models"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.worker_models.json
}

data "aws_iam_policy_document" "worker_models" {
  statement {
    sid       = "ListModels"
    actions   = ["s3:ListBucket"]
    resources = [local.model_bucket_arn]
  }

  statement {
    sid       = "ReadModels"
    actions   = ["s3:GetObject"]
    resources = ["${local.model_bucket_arn}/*"]
  }

  statement {
    sid       = "DecryptModels"
    actions   = ["kms:Decrypt"]
    resources = [local.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${local.region}.amazonaws.com"]
    }
  }
}
