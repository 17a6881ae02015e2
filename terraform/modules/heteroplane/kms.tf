# One customer-managed key for what this deployment stores: the volumes of the control plane and
# the workers, the model bucket, the RDS instance and its secret, the admin token's parameter.
# IAM policies grant its use (iam.tf); the key policy delegates to them, as AWS's default does.

resource "aws_kms_key" "this" {
  count = var.kms_key_arn == null ? 1 : 0

  description             = "heteroplane ${var.name}: volumes, model bucket, database, admin token"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json

  tags = merge(local.tags, { Name = var.name })
}

resource "aws_kms_alias" "this" {
  count = var.kms_key_arn == null ? 1 : 0

  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this[0].key_id
}

data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_109:a key policy's Resource "*" is the key itself; this is AWS's default key policy, which leaves the key's use to IAM policies
  #checkov:skip=CKV_AWS_111:as above: the account root statement of AWS's default key policy
  #checkov:skip=CKV_AWS_356:as above: in a key policy "*" means this key
  statement {
    sid       = "AccountAdministersAndDelegatesToIam"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:root"]
    }
  }
}
