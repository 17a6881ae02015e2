# TLS in front of the API (with var.api_certificate_arn): an Application Load Balancer ends TLS
# with the user's ACM certificate (HTTPS on 443, a modern policy: TLS 1.2 and 1.3 only), answers
# plain HTTP on 80 with a redirect to HTTPS, and forwards to the host's API port, which admits
# the load balancer's security group alone (security_groups.tf). Why a load balancer and not a
# reverse proxy on the host (docs/deployment.md): the certificate's private key never leaves
# ACM (never in the user data, the state or on the host), ACM renews it, and the host needs no
# public IP. The cost is an ALB's hourly charge.

resource "aws_lb" "api" {
  count = local.tls ? 1 : 0
  #checkov:skip=CKV_AWS_91:access logs need a log bucket with an ELB-account bucket policy; the control plane keeps its own audit trail (decisions, budget changes) and the cost is the user's call
  #checkov:skip=CKV2_AWS_28:a WAF is a separate paid service with its own rules; the API is open to api_allowed_cidr only and every route but /healthz needs a token
  #checkov:skip=CKV2_AWS_76:no WAF (see CKV2_AWS_28), so no Log4j rule set either; the service runs no Java
  #checkov:skip=CKV_AWS_150:deletion protection would make terraform destroy fail; the load balancer holds no state and is recreated in minutes

  name               = "${var.name}-api"
  load_balancer_type = "application"
  internal           = !local.load_balancer_public
  subnets            = local.load_balancer_subnet_ids
  security_groups    = [aws_security_group.load_balancer[0].id]
  # Requests with header fields that are not valid HTTP are dropped, not passed to the service.
  drop_invalid_header_fields = true
  desync_mitigation_mode     = "strictest"
  # How long the ALB keeps an idle connection, to the client and to the service. The service
  # keeps its side longer (http_keep_alive_s, 75 s), so the ALB, never the service, closes an
  # idle connection to it: a close from the service as the ALB sends a query on it would be a 502.
  idle_timeout = 60

  tags = merge(local.tags, { Name = "${var.name}-api" })

  lifecycle {
    precondition {
      condition     = length(local.load_balancer_subnet_ids) >= 2
      error_message = "An Application Load Balancer needs subnets in at least two zones: give a new VPC two availability_zones, or an existing one load_balancer_subnet_ids."
    }
  }
}

resource "aws_lb_target_group" "api" {
  count = local.tls ? 1 : 0
  #checkov:skip=CKV_AWS_378:TLS ends at the load balancer; the hop to the host stays inside the VPC, to a port that admits the load balancer's group alone

  name        = "${var.name}-api"
  port        = var.api_port
  protocol    = "HTTP"
  target_type = "instance"
  vpc_id      = local.vpc_id

  health_check {
    path                = "/healthz"
    protocol            = "HTTP"
    matcher             = "200"
    interval            = 15
    healthy_threshold   = 2
    unhealthy_threshold = 3
  }

  tags = local.tags
}

resource "aws_lb_target_group_attachment" "api" {
  count = local.tls ? 1 : 0

  target_group_arn = aws_lb_target_group.api[0].arn
  target_id        = aws_instance.control_plane.id
  port             = var.api_port
}

resource "aws_lb_listener" "https" {
  count = local.tls ? 1 : 0

  load_balancer_arn = aws_lb.api[0].arn
  port              = 443
  protocol          = "HTTPS"
  ssl_policy        = "ELBSecurityPolicy-TLS13-1-2-2021-06"
  certificate_arn   = var.api_certificate_arn

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.api[0].arn
  }

  tags = local.tags

  lifecycle {
    # A load balancer takes only its own region's ACM certificates: at plan, not at apply.
    precondition {
      condition     = split(":", var.api_certificate_arn)[3] == local.region
      error_message = "api_certificate_arn is a certificate of ${split(":", var.api_certificate_arn)[3]}, and the load balancer is in ${local.region}: ACM certificates serve only their own region's load balancers; request or import it in ${local.region}."
    }
  }
}

# Plain HTTP only answers with the same URL on HTTPS (no content, no token ever accepted).
resource "aws_lb_listener" "http" {
  count = local.tls ? 1 : 0

  load_balancer_arn = aws_lb.api[0].arn
  port              = 80
  protocol          = "HTTP"

  default_action {
    type = "redirect"
    redirect {
      port        = "443"
      protocol    = "HTTPS"
      status_code = "HTTP_301"
    }
  }

  tags = local.tags
}
