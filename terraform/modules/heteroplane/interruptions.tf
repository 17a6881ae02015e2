# Spot interruption notices, as Karpenter takes them: EventBridge rules for EC2 Spot Instance
# Interruption Warnings, EC2 Instance Rebalance Recommendations and EC2 Instance State-change
# Notifications send the events to one SQS queue, which the control plane reads
# (provisioners/spot.py, HETEROPLANE_EC2_INTERRUPTION_QUEUE_URL) and deletes from. The queue is
# encrypted with SQS-managed keys (EventBridge cannot use a customer key the key policy does not
# name it in), accepts messages from these rules alone, and keeps them five minutes: a notice
# older than the two minutes it gives is of no use. The control plane's role may receive and
# delete on this queue and nothing else of SQS (iam.tf).

locals {
  interruption_events = {
    spot-interruption = "EC2 Spot Instance Interruption Warning"
    rebalance         = "EC2 Instance Rebalance Recommendation"
    state-change      = "EC2 Instance State-change Notification"
  }
}

resource "aws_sqs_queue" "interruptions" {
  name                      = "${var.name}-interruptions"
  message_retention_seconds = 300
  sqs_managed_sse_enabled   = true
  tags                      = local.tags
}

resource "aws_cloudwatch_event_rule" "interruptions" {
  for_each = local.interruption_events

  name        = "${var.name}-${each.key}"
  description = "heteroplane ${var.name}: ${each.value} to the interruption queue"
  event_pattern = jsonencode({
    source      = ["aws.ec2"]
    detail-type = [each.value]
  })
  tags = local.tags
}

resource "aws_cloudwatch_event_target" "interruptions" {
  for_each = local.interruption_events

  rule = aws_cloudwatch_event_rule.interruptions[each.key].name
  arn  = aws_sqs_queue.interruptions.arn
}

resource "aws_sqs_queue_policy" "interruptions" {
  queue_url = aws_sqs_queue.interruptions.id
  policy    = data.aws_iam_policy_document.interruption_queue.json
}

data "aws_iam_policy_document" "interruption_queue" {
  statement {
    sid       = "EventBridgeSendsTheRulesEvents"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.interruptions.arn]

    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [for rule in aws_cloudwatch_event_rule.interruptions : rule.arn]
    }
  }

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["sqs:*"]
    resources = [aws_sqs_queue.interruptions.arn]

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

resource "aws_iam_role_policy" "control_plane_interruptions" {
  name   = "interruptions"
  role   = aws_iam_role.control_plane.id
  policy = data.aws_iam_policy_document.control_plane_interruptions.json
}

data "aws_iam_policy_document" "control_plane_interruptions" {
  # Read and delete the notices, on this queue only (DeleteMessageBatch is sqs:DeleteMessage).
  statement {
    sid       = "ReadInterruptionNotices"
    actions   = ["sqs:ReceiveMessage", "sqs:DeleteMessage"]
    resources = [aws_sqs_queue.interruptions.arn]
  }
}
