# PostgreSQL on RDS (var.database = "postgresql"): private, encrypted with the deployment's key,
# the master password managed by RDS in Secrets Manager (never in the state), reachable only from
# the control plane's security group.

resource "aws_db_subnet_group" "this" {
  count = var.database == "postgresql" ? 1 : 0

  name        = var.name
  description = "heteroplane ${var.name}: private subnets of the database"
  subnet_ids  = local.worker_subnet_ids
  tags        = local.tags

  lifecycle {
    precondition {
      condition     = length(local.worker_subnet_ids) >= 2
      error_message = "database = \"postgresql\" needs private subnets in at least two zones (availability_zones, or worker_subnet_ids)."
    }
  }
}

# Slow statements and schema changes go to the exported PostgreSQL log; TLS only (the host's URL
# asks for sslmode=require).
resource "aws_db_parameter_group" "this" {
  count = var.database == "postgresql" ? 1 : 0

  name_prefix = "${var.name}-"
  family      = "postgres${split(".", var.db_engine_version)[0]}"
  description = "heteroplane ${var.name}: query logging, TLS only"

  parameter {
    name  = "log_statement"
    value = "ddl"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }

  tags = local.tags

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_db_instance" "this" {
  #checkov:skip=CKV_AWS_118:enhanced monitoring needs a monitoring role and costs per instance; CloudWatch's basic RDS metrics and the exported logs cover a control plane's database
  #checkov:skip=CKV_AWS_157:a standby doubles the cost of a small database; set db_multi_az = true for one
  count = var.database == "postgresql" ? 1 : 0

  identifier     = var.name
  engine         = "postgres"
  engine_version = var.db_engine_version
  instance_class = var.db_instance_class

  allocated_storage = var.db_allocated_storage_gib
  storage_type      = "gp3"
  storage_encrypted = true
  kms_key_id        = local.kms_key_arn

  db_name                       = "heteroplane"
  username                      = "heteroplane"
  manage_master_user_password   = true
  master_user_secret_kms_key_id = local.kms_key_arn

  db_subnet_group_name   = aws_db_subnet_group.this[0].name
  parameter_group_name   = aws_db_parameter_group.this[0].name
  vpc_security_group_ids = [aws_security_group.database[0].id]
  publicly_accessible    = false
  multi_az               = var.db_multi_az

  iam_database_authentication_enabled   = true
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = local.kms_key_arn
  enabled_cloudwatch_logs_exports       = ["postgresql", "upgrade"]
  auto_minor_version_upgrade            = true
  backup_retention_period               = 7
  copy_tags_to_snapshot                 = true
  deletion_protection                   = var.db_deletion_protection
  skip_final_snapshot                   = false
  final_snapshot_identifier             = "${var.name}-final"
  delete_automated_backups              = false
  performance_insights_retention_period = 7

  tags = local.tags
}
