# The root a user applies: the AWS provider (providers.tf) and the heteroplane module with this
# root's variables passed through. To embed heteroplane in a configuration of your own, call
# ./modules/heteroplane the same way with your own provider.

module "heteroplane" {
  source = "./modules/heteroplane"

  name                        = var.name
  tags                        = var.tags
  vpc_id                      = var.vpc_id
  control_plane_subnet_id     = var.control_plane_subnet_id
  worker_subnet_ids           = var.worker_subnet_ids
  vpc_cidr                    = var.vpc_cidr
  availability_zones          = var.availability_zones
  create_nat_gateway          = var.create_nat_gateway
  api_allowed_cidr            = var.api_allowed_cidr
  allow_public_api            = var.allow_public_api
  api_certificate_arn         = var.api_certificate_arn
  api_domain_name             = var.api_domain_name
  allow_plain_http            = var.allow_plain_http
  load_balancer_subnet_ids    = var.load_balancer_subnet_ids
  api_port                    = var.api_port
  worker_port                 = var.worker_port
  worker_instance_types       = var.worker_instance_types
  allowed_instance_types      = var.allowed_instance_types
  worker_ami_id               = var.worker_ami_id
  worker_volume_size_gib      = var.worker_volume_size_gib
  model_bucket_name           = var.model_bucket_name
  model_bucket_force_destroy  = var.model_bucket_force_destroy
  control_plane_instance_type = var.control_plane_instance_type
  control_plane_ami_id        = var.control_plane_ami_id
  control_plane_public_ip     = var.control_plane_public_ip
  detailed_monitoring         = var.detailed_monitoring
  heteroplane_git_url         = var.heteroplane_git_url
  heteroplane_git_ref         = var.heteroplane_git_ref
  default_budget_usd_per_hr   = var.default_budget_usd_per_hr
  default_slo_latency_ms      = var.default_slo_latency_ms
  default_slo_percentile      = var.default_slo_percentile
  database                    = var.database
  sqlite_volume_size_gib      = var.sqlite_volume_size_gib
  db_instance_class           = var.db_instance_class
  db_engine_version           = var.db_engine_version
  db_allocated_storage_gib    = var.db_allocated_storage_gib
  db_multi_az                 = var.db_multi_az
  db_deletion_protection      = var.db_deletion_protection
  kms_key_arn                 = var.kms_key_arn
}
