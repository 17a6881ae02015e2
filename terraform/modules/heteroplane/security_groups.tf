# Who reaches whom: the API only from var.api_allowed_cidr (with a certificate: the load
# balancer's 443 and 80 from there, and the host's API port from the load balancer alone); the
# workers' agent port only from the control plane; PostgreSQL only from the control plane. Outbound, the hosts reach HTTPS (AWS
# APIs, the package index, the git repository) and HTTP (the OS's package mirrors), the control
# plane also its workers and its database. Rules are resources of their own, so the groups can
# refer to each other (aws_security_group_rule rather than aws_vpc_security_group_*_rule: moto,
# which the end-to-end test runs against, drops the description of a rule that references a
# group in DescribeSecurityGroupRules, and a plan after apply would never be clean).

resource "aws_security_group" "control_plane" {
  name        = "${var.name}-control-plane"
  description = "heteroplane control plane: the API"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-control-plane" })
}

resource "aws_security_group" "workers" {
  name        = "${var.name}-workers"
  description = "heteroplane workers: the agent port, from the control plane"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-workers" })
}

resource "aws_security_group" "load_balancer" {
  count = local.tls ? 1 : 0

  name        = "${var.name}-load-balancer"
  description = "heteroplane API load balancer: HTTPS and the redirect from HTTP"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-load-balancer" })
}

resource "aws_security_group" "database" {
  count = var.database == "postgresql" ? 1 : 0

  name        = "${var.name}-database"
  description = "heteroplane database: PostgreSQL, from the control plane"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-database" })
}

# --- the control plane --------------------------------------------------------------------------

# The API port: from the allowed CIDR, or with a certificate from the load balancer alone.
resource "aws_security_group_rule" "api" {
  type                     = "ingress"
  security_group_id        = aws_security_group.control_plane.id
  description              = local.tls ? "the API, from the load balancer only" : "the API, from the allowed CIDR"
  protocol                 = "tcp"
  from_port                = var.api_port
  to_port                  = var.api_port
  cidr_blocks              = local.tls ? null : [var.api_allowed_cidr]
  source_security_group_id = local.tls ? aws_security_group.load_balancer[0].id : null
}

resource "aws_security_group_rule" "control_plane_https" {
  type              = "egress"
  security_group_id = aws_security_group.control_plane.id
  description       = "AWS APIs, the package index, the git repository"
  protocol          = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_blocks       = ["0.0.0.0/0"]
}

resource "aws_security_group_rule" "control_plane_http" {
  type              = "egress"
  security_group_id = aws_security_group.control_plane.id
  description       = "the OS package mirrors"
  protocol          = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_blocks       = ["0.0.0.0/0"]
}

resource "aws_security_group_rule" "control_plane_to_workers" {
  type                     = "egress"
  security_group_id        = aws_security_group.control_plane.id
  description              = "the worker agents"
  protocol                 = "tcp"
  from_port                = var.worker_port
  to_port                  = var.worker_port
  source_security_group_id = aws_security_group.workers.id
}

resource "aws_security_group_rule" "control_plane_to_database" {
  count = var.database == "postgresql" ? 1 : 0

  type                     = "egress"
  security_group_id        = aws_security_group.control_plane.id
  description              = "PostgreSQL"
  protocol                 = "tcp"
  from_port                = 5432
  to_port                  = 5432
  source_security_group_id = aws_security_group.database[0].id
}

# --- the load balancer (with a certificate) -----------------------------------------------------

resource "aws_security_group_rule" "load_balancer_https" {
  count = local.tls ? 1 : 0

  type              = "ingress"
  security_group_id = aws_security_group.load_balancer[0].id
  description       = "HTTPS, from the allowed CIDR"
  protocol          = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_blocks       = [var.api_allowed_cidr]
}

resource "aws_security_group_rule" "load_balancer_http" {
  count = local.tls ? 1 : 0

  type              = "ingress"
  security_group_id = aws_security_group.load_balancer[0].id
  description       = "HTTP, answered with a redirect to HTTPS, from the allowed CIDR"
  protocol          = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_blocks       = [var.api_allowed_cidr]
}

resource "aws_security_group_rule" "load_balancer_to_api" {
  count = local.tls ? 1 : 0

  type                     = "egress"
  security_group_id        = aws_security_group.load_balancer[0].id
  description              = "the API on the control plane"
  protocol                 = "tcp"
  from_port                = var.api_port
  to_port                  = var.api_port
  source_security_group_id = aws_security_group.control_plane.id
}

# --- the workers --------------------------------------------------------------------------------

resource "aws_security_group_rule" "worker_agent" {
  type                     = "ingress"
  security_group_id        = aws_security_group.workers.id
  description              = "the worker agent, from the control plane only"
  protocol                 = "tcp"
  from_port                = var.worker_port
  to_port                  = var.worker_port
  source_security_group_id = aws_security_group.control_plane.id
}

resource "aws_security_group_rule" "workers_https" {
  type              = "egress"
  security_group_id = aws_security_group.workers.id
  description       = "the model bucket, the package index, the git repository"
  protocol          = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_blocks       = ["0.0.0.0/0"]
}

resource "aws_security_group_rule" "workers_http" {
  type              = "egress"
  security_group_id = aws_security_group.workers.id
  description       = "the OS package mirrors"
  protocol          = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_blocks       = ["0.0.0.0/0"]
}

# --- the database -------------------------------------------------------------------------------

resource "aws_security_group_rule" "database" {
  count = var.database == "postgresql" ? 1 : 0

  type                     = "ingress"
  security_group_id        = aws_security_group.database[0].id
  description              = "PostgreSQL, from the control plane only"
  protocol                 = "tcp"
  from_port                = 5432
  to_port                  = 5432
  source_security_group_id = aws_security_group.control_plane.id
}
