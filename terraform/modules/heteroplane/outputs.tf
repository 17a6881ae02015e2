output "api_url" {
  description = "URL of the control plane's REST API (reachable from api_allowed_cidr): https:// through the load balancer with a certificate, else http:// to the host."
  value       = local.tls ? "https://${coalesce(var.api_domain_name, aws_lb.api[0].dns_name)}" : "http://${local.control_plane_address}:${var.api_port}"
}

output "load_balancer_dns_name" {
  description = "DNS name of the API's load balancer (point api_domain_name at it); null without a certificate."
  value       = local.tls ? aws_lb.api[0].dns_name : null
}

output "launch_templates" {
  description = "Launch template id by candidate worker instance type (the control plane's ec2.launch_templates)."
  value       = local.launch_templates
}

output "launch_template_names" {
  description = "Launch template name by candidate worker instance type."
  value       = { for t in var.worker_instance_types : t => aws_launch_template.worker[t].name }
}

output "vpc_id" {
  description = "The VPC of the deployment."
  value       = local.vpc_id
}

output "worker_subnet_ids" {
  description = "Subnets workers are launched into, in the order they are tried (ec2.subnet_ids)."
  value       = local.worker_subnet_ids
}

output "control_plane_subnet_id" {
  description = "Subnet of the control-plane host."
  value       = local.control_plane_subnet_id
}

output "security_group_ids" {
  description = "Security groups: control_plane (the API), workers (the agent port, ec2.security_group_ids), database (PostgreSQL only) and load_balancer (with a certificate only)."
  value = {
    control_plane = aws_security_group.control_plane.id
    workers       = aws_security_group.workers.id
    database      = var.database == "postgresql" ? aws_security_group.database[0].id : null
    load_balancer = local.tls ? aws_security_group.load_balancer[0].id : null
  }
}

output "control_plane_instance_id" {
  description = "EC2 instance id of the control-plane host."
  value       = aws_instance.control_plane.id
}

output "control_plane_environment" {
  description = "The control plane's settings as HETEROPLANE_* environment variables (what the host's /etc/heteroplane/heteroplane.env holds; no secrets)."
  value       = local.control_plane_environment
}

output "admin_token_ssm_parameter" {
  description = "SSM parameter (SecureString) where the control plane stores its admin token at its first start; terraform never holds the token."
  value       = aws_ssm_parameter.admin_token.name
}

output "admin_token_command" {
  description = "Command that prints the admin token."
  value       = "aws ssm get-parameter --region ${local.region} --name ${aws_ssm_parameter.admin_token.name} --with-decryption --query Parameter.Value --output text"
}

output "model_bucket" {
  description = "S3 bucket the workers read models from, and the model registry keeps its artifacts in (its models/ prefix; the control plane's ec2.model_bucket)."
  value       = local.model_bucket
}

output "kms_key_arn" {
  description = "KMS key encrypting the volumes, the model bucket, the database and the admin token."
  value       = local.kms_key_arn
}

output "roles" {
  description = "IAM roles: control_plane (the provisioner's permissions) and worker (reads the model bucket)."
  value = {
    control_plane = aws_iam_role.control_plane.arn
    worker        = aws_iam_role.worker.arn
  }
}

output "database" {
  description = "Where the control plane's state lives: sqlite (the volume id) or postgresql (the endpoint and the RDS-managed secret's ARN)."
  value = var.database == "sqlite" ? {
    kind      = "sqlite"
    volume_id = aws_ebs_volume.data[0].id
    endpoint  = null
    secret    = null
    } : {
    kind      = "postgresql"
    volume_id = null
    endpoint  = aws_db_instance.this[0].endpoint
    secret    = aws_db_instance.this[0].master_user_secret[0].secret_arn
  }
}

output "app_defaults" {
  description = "Defaults for new apps (budget, SLO, candidate types), also in /etc/heteroplane/app-defaults.yaml on the host."
  value       = local.app_defaults
}

output "interruption_queue_url" {
  description = "URL of the SQS queue EventBridge fills with spot interruption, rebalance and state-change notices (the control plane's ec2.interruption_queue_url)."
  value       = aws_sqs_queue.interruptions.url
}
