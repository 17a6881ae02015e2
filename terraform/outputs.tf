output "api_url" {
  description = "URL of the control plane's REST API (reachable from api_allowed_cidr): https:// through the load balancer with a certificate, else http:// to the host."
  value       = module.heteroplane.api_url
}

output "load_balancer_dns_name" {
  description = "DNS name of the API's load balancer (point api_domain_name at it); null without a certificate."
  value       = module.heteroplane.load_balancer_dns_name
}

output "launch_templates" {
  description = "Launch template id by candidate worker instance type (the control plane's ec2.launch_templates)."
  value       = module.heteroplane.launch_templates
}

output "launch_template_names" {
  description = "Launch template name by candidate worker instance type."
  value       = module.heteroplane.launch_template_names
}

output "vpc_id" {
  description = "The VPC of the deployment."
  value       = module.heteroplane.vpc_id
}

output "worker_subnet_ids" {
  description = "Subnets workers are launched into, in the order they are tried (ec2.subnet_ids)."
  value       = module.heteroplane.worker_subnet_ids
}

output "control_plane_subnet_id" {
  description = "Subnet of the control-plane host."
  value       = module.heteroplane.control_plane_subnet_id
}

output "security_group_ids" {
  description = "Security groups: control_plane (the API), workers (the agent port, ec2.security_group_ids), database (PostgreSQL only) and load_balancer (with a certificate only)."
  value       = module.heteroplane.security_group_ids
}

output "control_plane_instance_id" {
  description = "EC2 instance id of the control-plane host."
  value       = module.heteroplane.control_plane_instance_id
}

output "control_plane_environment" {
  description = "The control plane's settings as HETEROPLANE_* environment variables (what the host's /etc/heteroplane/heteroplane.env holds; no secrets)."
  value       = module.heteroplane.control_plane_environment
}

output "admin_token_ssm_parameter" {
  description = "SSM parameter (SecureString) where the control plane stores its admin token at its first start; terraform never holds the token."
  value       = module.heteroplane.admin_token_ssm_parameter
}

output "admin_token_command" {
  description = "Command that prints the admin token."
  value       = module.heteroplane.admin_token_command
}

output "model_bucket" {
  description = "S3 bucket the workers read models from, and the model registry keeps its artifacts in (its models/ prefix; the control plane's ec2.model_bucket)."
  value       = module.heteroplane.model_bucket
}

output "kms_key_arn" {
  description = "KMS key encrypting the volumes, the model bucket, the database and the admin token."
  value       = module.heteroplane.kms_key_arn
}

output "roles" {
  description = "IAM roles: control_plane (the provisioner's permissions) and worker (reads the model bucket)."
  value       = module.heteroplane.roles
}

output "database" {
  description = "Where the control plane's state lives: sqlite (the volume id) or postgresql (the endpoint and the RDS-managed secret's ARN)."
  value       = module.heteroplane.database
}

output "app_defaults" {
  description = "Defaults for new apps (budget, SLO, candidate types), also in /etc/heteroplane/app-defaults.yaml on the host."
  value       = module.heteroplane.app_defaults
}

output "interruption_queue_url" {
  description = "URL of the SQS queue EventBridge fills with spot interruption, rebalance and state-change notices (the control plane's ec2.interruption_queue_url)."
  value       = module.heteroplane.interruption_queue_url
}
