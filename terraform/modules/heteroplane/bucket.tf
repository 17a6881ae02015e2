# The model bucket (unless var.model_bucket_name names an existing one): private, encrypted with
# the deployment's key, versioned, TLS only. Workers read it (iam.tf): at boot they copy the files
# directly under models/ (the demo family's) into their model cache, and a worker serving a
# user's model downloads that artifact (models/<name>/<version>/...), which the control plane's
# model registry put there.

resource "aws_s3_bucket" "models" {
  #checkov:skip=CKV_AWS_18:access logs need a second bucket and a retention policy, the account's choice; the bucket is private and read only by the workers' role
  #checkov:skip=CKV_AWS_144:models can be rebuilt or uploaded again; cross-region replication would double the storage for no availability the workers need
  #checkov:skip=CKV2_AWS_62:nothing reacts to new models; workers read the bucket when they boot
  count = var.model_bucket_name == null ? 1 : 0

  bucket_prefix = "${var.name}-models-"
  force_destroy = var.model_bucket_force_destroy

  tags = merge(local.tags, { Name = "${var.name}-models" })
}

resource "aws_s3_bucket_public_access_block" "models" {
  count = var.model_bucket_name == null ? 1 : 0

  bucket                  = aws_s3_bucket.models[0].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "models" {
  count = var.model_bucket_name == null ? 1 : 0

  bucket = aws_s3_bucket.models[0].id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "models" {
  count = var.model_bucket_name == null ? 1 : 0

  bucket = aws_s3_bucket.models[0].id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = local.kms_key_arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_versioning" "models" {
  count = var.model_bucket_name == null ? 1 : 0

  bucket = aws_s3_bucket.models[0].id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "models" {
  count = var.model_bucket_name == null ? 1 : 0

  bucket = aws_s3_bucket.models[0].id

  rule {
    id     = "tidy"
    status = "Enabled"
    # Every object. (An empty prefix rather than an empty filter block: the same rule to S3,
    # and what S3, and moto, answer back, so plans stay clean.)
    filter {
      prefix = ""
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
    noncurrent_version_expiration {
      noncurrent_days = 90
    }
  }

  depends_on = [aws_s3_bucket_versioning.models]
}

resource "aws_s3_bucket_policy" "models" {
  count = var.model_bucket_name == null ? 1 : 0

  bucket = aws_s3_bucket.models[0].id
  policy = data.aws_iam_policy_document.models_bucket.json

  depends_on = [aws_s3_bucket_public_access_block.models]
}

data "aws_iam_policy_document" "models_bucket" {
  statement {
    sid       = "TlsOnly"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [local.model_bucket_arn, "${local.model_bucket_arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}
