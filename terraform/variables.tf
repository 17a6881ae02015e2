# The root's inputs: the provider's (region, aws_endpoint_url) and the module's, passed through.
# The module (modules/heteroplane/variables.tf) validates them; tests/unit/test_terraform_hcl.py
# checks that both declare the same names, types, descriptions and defaults.

# --- provider -----------------------------------------------------------------------------------

variable "region" {
  description = "AWS region to deploy into, e.g. us-east-1."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "aws_endpoint_url" {
  description = "Testing only: one endpoint URL for every AWS service (a moto server on 127.0.0.1); it also turns off the provider's credential and account checks. Leave null for AWS."
  type        = string
  default     = null

  validation {
    condition     = var.aws_endpoint_url == null || can(regex("^https?://", coalesce(var.aws_endpoint_url, "none")))
    error_message = "aws_endpoint_url must be null or an http(s) URL."
  }
}

# --- naming -------------------------------------------------------------------------------------

variable "name" {
  description = "Name of this deployment: the prefix of every resource name and the control plane's EC2 tag prefix (tags <name>:managed, <name>:app, ...). Two deployments in one account need two names."
  type        = string
  default     = "heteroplane"
}

variable "tags" {
  description = "Tags added to every resource this module creates (the workers get the control plane's own tags)."
  type        = map(string)
  default     = {}
}

# --- network ------------------------------------------------------------------------------------

variable "vpc_id" {
  description = "An existing VPC to deploy into (then control_plane_subnet_id and worker_subnet_ids are required); null creates a new VPC with a public and a private subnet per zone."
  type        = string
  default     = null
}

variable "control_plane_subnet_id" {
  description = "With an existing VPC: the subnet of the control-plane instance (a public one when control_plane_public_ip is true). Ignored for a new VPC."
  type        = string
  default     = null
}

variable "worker_subnet_ids" {
  description = "With an existing VPC: the private subnets workers are launched into, one per zone, tried in order. They must not assign public IPs. Ignored for a new VPC."
  type        = list(string)
  default     = []
}

variable "vpc_cidr" {
  description = "CIDR block of a new VPC (/16 to /24); each zone gets a public and a private subnet carved from it."
  type        = string
  default     = "10.42.0.0/16"
}

variable "availability_zones" {
  description = "Zones of a new VPC (one public and one private subnet each); empty: the region's first two. A PostgreSQL database needs two."
  type        = list(string)
  default     = []
}

variable "create_nat_gateway" {
  description = "For a new VPC: a NAT gateway, so that workers (no public IP) reach the package index and the source repository at boot. Turn off only when the worker AMI has everything baked in."
  type        = bool
  default     = true
}

variable "api_allowed_cidr" {
  description = "The IPv4 CIDR block allowed to reach the API (e.g. your office, 203.0.113.0/24): the load balancer with a certificate, else the host. Nothing else reaches it; 0.0.0.0/0 only with allow_public_api."
  type        = string
}

variable "allow_public_api" {
  description = "Whether api_allowed_cidr may be 0.0.0.0/0, the whole internet. Off: a /0 is refused, so that an API open to everyone is a decision, never a default."
  type        = bool
  default     = false
}

variable "api_port" {
  description = "TCP port of the control plane's API."
  type        = number
  default     = 8000
}

variable "worker_port" {
  description = "TCP port the worker agent listens on; only the control plane may reach it."
  type        = number
  default     = 8080
}

# --- TLS ---------------------------------------------------------------------------------------

variable "api_certificate_arn" {
  description = "An ACM certificate (ARN, in this region) for the API's domain: an Application Load Balancer ends TLS with it (HTTPS on 443; HTTP on 80 answers a redirect to HTTPS) and the host is reachable from the load balancer only. null: no TLS, which needs allow_plain_http."
  type        = string
  default     = null
}

variable "api_domain_name" {
  description = "The domain name the certificate is for, used in the API URL (point a DNS record of it at output load_balancer_dns_name); null: the load balancer's own name, which the certificate does not cover."
  type        = string
  default     = null
}

variable "allow_plain_http" {
  description = "Whether the API may be plain HTTP, without a certificate (api_certificate_arn null): API tokens then cross the network in clear text. Off: a certificate is required."
  type        = bool
  default     = false
}

variable "load_balancer_subnet_ids" {
  description = "With an existing VPC and a certificate: the load balancer's subnets, at least two in different zones (public ones when control_plane_public_ip is true). Ignored for a new VPC (its public subnets; its private ones without a public IP)."
  type        = list(string)
  default     = []
}

# --- workers ------------------------------------------------------------------------------------

variable "worker_instance_types" {
  description = "Candidate worker instance types: one launch template each, the types plans may use."
  type        = list(string)
  default     = ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge"]
}

variable "allowed_instance_types" {
  description = "The instance types the control plane's role may launch (the ec2:InstanceType condition of its RunInstances grant); by default every EC2 type of heteroplane's catalog (estimator/data/instance_types.csv). Every worker_instance_types entry must be one of them."
  type        = list(string)
  default = [
    "g4dn.xlarge",
    "g4dn.2xlarge",
    "g4dn.4xlarge",
    "g4dn.8xlarge",
    "g4dn.12xlarge",
    "g4dn.16xlarge",
    "g5.xlarge",
    "g5.2xlarge",
    "g5.4xlarge",
    "g5.8xlarge",
    "g5.12xlarge",
    "g5.16xlarge",
    "g5.24xlarge",
    "g5.48xlarge",
    "g6.xlarge",
    "g6.2xlarge",
    "g6.4xlarge",
    "g6.8xlarge",
    "g6.12xlarge",
    "g6.16xlarge",
    "g6.24xlarge",
    "g6.48xlarge",
    "p3.2xlarge",
    "p3.8xlarge",
    "p3.16xlarge",
    "c5.large",
    "c5.xlarge",
    "c5.2xlarge",
    "c5.4xlarge",
    "c5.9xlarge",
    "c5n.large",
    "c5n.xlarge",
    "c5n.2xlarge",
    "c5n.4xlarge",
    "c6i.large",
    "c6i.xlarge",
    "c6i.2xlarge",
    "c6i.4xlarge",
    "c6i.8xlarge",
    "m5.large",
    "m5.xlarge",
    "m5.2xlarge",
    "m5.4xlarge",
    "r5.large",
    "r5.xlarge",
    "r5.2xlarge",
    "r5n.large",
    "r5n.xlarge",
    "r5n.2xlarge",
    "t3.medium",
    "t3.large",
    "t3.xlarge",
    "t3.2xlarge",
  ]
}

variable "worker_ami_id" {
  description = "AMI of the workers (for GPU types one with the NVIDIA driver, e.g. an AWS Deep Learning Base AMI), with Python >= 3.11 or a package manager that installs it."
  type        = string
}

variable "worker_volume_size_gib" {
  description = "Size of a worker's root volume, GiB (encrypted); at least the AMI's snapshot."
  type        = number
  default     = 100
}

variable "model_bucket_name" {
  description = "An existing S3 bucket holding the models (workers get read access to it alone and copy the files directly under its models/ prefix into their cache at boot; the control plane's model registry keeps its artifacts below models/); null creates one."
  type        = string
  default     = null
}

variable "model_bucket_force_destroy" {
  description = "Whether destroying the deployment deletes a bucket this module created even when it still holds models."
  type        = bool
  default     = false
}

# --- control plane ------------------------------------------------------------------------------

variable "control_plane_instance_type" {
  description = "Instance type of the control-plane host."
  type        = string
  default     = "t3.medium"
}

variable "control_plane_ami_id" {
  description = "AMI of the control-plane host (Python >= 3.11, or a package manager that installs it); null uses worker_ami_id."
  type        = string
  default     = null
}

variable "control_plane_public_ip" {
  description = "Whether the control-plane host gets a public IP (the API is still reachable only from api_allowed_cidr); false: the API URL is its private address."
  type        = bool
  default     = true
}

variable "detailed_monitoring" {
  description = "CloudWatch detailed (1-minute) monitoring of the control plane and the workers."
  type        = bool
  default     = true
}

variable "heteroplane_git_url" {
  description = "Git repository (https://) the hosts install heteroplane from; the control plane needs a checkout, since its migrations live beside the package."
  type        = string
}

variable "heteroplane_git_ref" {
  description = "Branch, tag or whole commit id (40 hex digits) of heteroplane_git_url to install. A commit id (or a tag that never moves) pins the code: hosts booted later (a replaced control plane, every worker) install the same, where a branch installs its head at each boot."
  type        = string
  default     = "main"
}

# --- what apps get by default --------------------------------------------------------------------

variable "default_budget_usd_per_hr" {
  description = "Default cost budget of an app, USD per hour (written into the app-spec defaults on the control plane)."
  type        = number
  default     = 10
}

variable "default_slo_latency_ms" {
  description = "Default latency SLO of an app, ms."
  type        = number
  default     = 350
}

variable "default_slo_percentile" {
  description = "Percentile the default latency SLO applies to (99: P99)."
  type        = number
  default     = 99
}

# --- database -----------------------------------------------------------------------------------

variable "database" {
  description = "Where the control plane keeps its state: \"sqlite\" (a file on an encrypted EBS volume of its own, kept across host replacements) or \"postgresql\" (an RDS instance)."
  type        = string
  default     = "sqlite"
}

variable "sqlite_volume_size_gib" {
  description = "Size of the SQLite data volume, GiB (database = sqlite)."
  type        = number
  default     = 20
}

variable "db_instance_class" {
  description = "RDS instance class (database = postgresql)."
  type        = string
  default     = "db.t4g.micro"
}

variable "db_engine_version" {
  description = "PostgreSQL major (or major.minor) version of the RDS instance."
  type        = string
  default     = "16"
}

variable "db_allocated_storage_gib" {
  description = "Storage of the RDS instance, GiB (encrypted)."
  type        = number
  default     = 20
}

variable "db_multi_az" {
  description = "Whether the RDS instance has a standby in a second zone."
  type        = bool
  default     = false
}

variable "db_deletion_protection" {
  description = "Whether the RDS instance refuses deletion (turn off before destroying the deployment)."
  type        = bool
  default     = true
}

# --- encryption ---------------------------------------------------------------------------------

variable "kms_key_arn" {
  description = "A KMS key (ARN) for the volumes, the model bucket, the database and the admin token's parameter; null creates one (rotated yearly)."
  type        = string
  default     = null
}
