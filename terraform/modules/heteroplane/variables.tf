# The module's inputs. The root (../../variables.tf) declares the same ones, with the same types
# and descriptions, and passes them through (tests/unit/test_terraform_hcl.py checks they agree);
# the validation lives here, so a module caller gets it too.

# --- naming -------------------------------------------------------------------------------------

variable "name" {
  description = "Name of this deployment: the prefix of every resource name and the control plane's EC2 tag prefix (tags <name>:managed, <name>:app, ...). Two deployments in one account need two names."
  type        = string
  default     = "heteroplane"

  validation {
    condition     = can(regex("^[a-z]([a-z0-9]|-[a-z0-9]){0,19}$", var.name)) && length(var.name) <= 20
    error_message = "name must be 1-20 characters of a-z, 0-9 and '-', starting with a letter, not ending in '-' nor holding '--' (RDS and parameter group names refuse them)."
  }
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

  validation {
    condition     = var.vpc_id == null || can(regex("^vpc-[0-9a-f]+$", var.vpc_id))
    error_message = "vpc_id must be null (a new VPC) or a VPC id (vpc-...)."
  }
}

variable "control_plane_subnet_id" {
  description = "With an existing VPC: the subnet of the control-plane instance (a public one when control_plane_public_ip is true). Ignored for a new VPC."
  type        = string
  default     = null

  validation {
    condition     = var.vpc_id == null || can(regex("^subnet-[0-9a-f]+$", coalesce(var.control_plane_subnet_id, "missing")))
    error_message = "control_plane_subnet_id (subnet-...) is required when vpc_id is set."
  }
}

variable "worker_subnet_ids" {
  description = "With an existing VPC: the private subnets workers are launched into, one per zone, tried in order. They must not assign public IPs. Ignored for a new VPC."
  type        = list(string)
  default     = []

  validation {
    condition     = var.vpc_id == null || length(var.worker_subnet_ids) > 0
    error_message = "worker_subnet_ids needs at least one subnet when vpc_id is set."
  }
  validation {
    condition     = alltrue([for s in var.worker_subnet_ids : can(regex("^subnet-[0-9a-f]+$", s))])
    error_message = "worker_subnet_ids must be subnet ids (subnet-...)."
  }
}

variable "vpc_cidr" {
  description = "CIDR block of a new VPC (/16 to /24); each zone gets a public and a private subnet carved from it."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition = (
      can(cidrnetmask(var.vpc_cidr)) &&
      try(tonumber(split("/", var.vpc_cidr)[1]) >= 16 && tonumber(split("/", var.vpc_cidr)[1]) <= 24, false)
    )
    error_message = "vpc_cidr must be an IPv4 CIDR block from /16 to /24, e.g. 10.42.0.0/16."
  }
}

variable "availability_zones" {
  description = "Zones of a new VPC (one public and one private subnet each); empty: the region's first two. A PostgreSQL database needs two."
  type        = list(string)
  default     = []

  validation {
    condition     = length(var.availability_zones) <= 6 && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "availability_zones must be at most 6 distinct zones."
  }
}

variable "create_nat_gateway" {
  description = "For a new VPC: a NAT gateway, so that workers (no public IP) reach the package index and the source repository at boot. Turn off only when the worker AMI has everything baked in."
  type        = bool
  default     = true
}

variable "api_allowed_cidr" {
  description = "The IPv4 CIDR block allowed to reach the API (e.g. your office, 203.0.113.0/24): the load balancer with a certificate, else the host. Nothing else reaches it; 0.0.0.0/0 only with allow_public_api."
  type        = string

  validation {
    condition     = try(cidrhost(var.api_allowed_cidr, 0) == split("/", var.api_allowed_cidr)[0], false) && can(regex("^[0-9.]+/[0-9]+$", var.api_allowed_cidr))
    error_message = "api_allowed_cidr must be an IPv4 CIDR block with its host bits zero, e.g. 203.0.113.0/24."
  }
  validation {
    condition     = var.allow_public_api || !endswith(var.api_allowed_cidr, "/0")
    error_message = "api_allowed_cidr 0.0.0.0/0 opens the API to the whole internet: name your network's block, or set allow_public_api = true to mean it."
  }
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

  validation {
    condition     = var.api_port == floor(var.api_port) && var.api_port >= 1024 && var.api_port <= 65535
    error_message = "api_port must be an integer from 1024 to 65535 (the service does not run as root)."
  }
}

variable "worker_port" {
  description = "TCP port the worker agent listens on; only the control plane may reach it."
  type        = number
  default     = 8080

  validation {
    condition     = var.worker_port == floor(var.worker_port) && var.worker_port >= 1024 && var.worker_port <= 65535
    error_message = "worker_port must be an integer from 1024 to 65535."
  }
}

# --- TLS ---------------------------------------------------------------------------------------

variable "api_certificate_arn" {
  description = "An ACM certificate (ARN, in this region) for the API's domain: an Application Load Balancer ends TLS with it (HTTPS on 443; HTTP on 80 answers a redirect to HTTPS) and the host is reachable from the load balancer only. null: no TLS, which needs allow_plain_http."
  type        = string
  default     = null

  validation {
    condition     = var.api_certificate_arn == null || can(regex("^arn:aws[a-z-]*:acm:[a-z0-9-]+:[0-9]{12}:certificate/[A-Za-z0-9-]+$", coalesce(var.api_certificate_arn, "none")))
    error_message = "api_certificate_arn must be null or an ACM certificate ARN (arn:aws:acm:REGION:ACCOUNT:certificate/ID)."
  }
}

variable "api_domain_name" {
  description = "The domain name the certificate is for, used in the API URL (point a DNS record of it at output load_balancer_dns_name); null: the load balancer's own name, which the certificate does not cover."
  type        = string
  default     = null

  validation {
    condition     = var.api_domain_name == null || can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+[a-z]{2,63}$", coalesce(var.api_domain_name, "none")))
    error_message = "api_domain_name must be null or a lower-case DNS name such as api.example.com."
  }
}

variable "allow_plain_http" {
  description = "Whether the API may be plain HTTP, without a certificate (api_certificate_arn null): API tokens then cross the network in clear text. Off: a certificate is required."
  type        = bool
  default     = false

  validation {
    condition     = var.allow_plain_http || var.api_certificate_arn != null
    error_message = "The API needs TLS: set api_certificate_arn (an ACM certificate for its domain), or set allow_plain_http = true to serve it over plain HTTP."
  }
}

variable "load_balancer_subnet_ids" {
  description = "With an existing VPC and a certificate: the load balancer's subnets, at least two in different zones (public ones when control_plane_public_ip is true). Ignored for a new VPC (its public subnets; its private ones without a public IP)."
  type        = list(string)
  default     = []

  validation {
    condition     = var.vpc_id == null || var.api_certificate_arn == null || length(distinct(var.load_balancer_subnet_ids)) >= 2
    error_message = "With an existing VPC and a certificate, load_balancer_subnet_ids needs at least two subnets (in two zones)."
  }
  validation {
    condition     = alltrue([for s in var.load_balancer_subnet_ids : can(regex("^subnet-[0-9a-f]+$", s))])
    error_message = "load_balancer_subnet_ids must be subnet ids (subnet-...)."
  }
}

# --- workers ------------------------------------------------------------------------------------

variable "worker_instance_types" {
  description = "Candidate worker instance types: one launch template each, the types plans may use."
  type        = list(string)
  default     = ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge"]

  validation {
    condition     = length(var.worker_instance_types) > 0
    error_message = "worker_instance_types needs at least one instance type."
  }
  validation {
    condition     = alltrue([for t in var.worker_instance_types : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", t))])
    error_message = "worker_instance_types must be EC2 instance type names such as g4dn.xlarge."
  }
  validation {
    condition     = length(distinct(var.worker_instance_types)) == length(var.worker_instance_types)
    error_message = "worker_instance_types must not repeat a type."
  }
  validation {
    condition     = alltrue([for t in var.worker_instance_types : contains(var.allowed_instance_types, t)])
    error_message = "every worker_instance_types entry must be in allowed_instance_types (the types the control plane's role may launch)."
  }
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

  validation {
    condition     = length(var.allowed_instance_types) > 0 && length(distinct(var.allowed_instance_types)) == length(var.allowed_instance_types)
    error_message = "allowed_instance_types needs at least one instance type, none repeated."
  }
  validation {
    condition     = alltrue([for t in var.allowed_instance_types : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", t))])
    error_message = "allowed_instance_types must be EC2 instance type names such as g4dn.xlarge."
  }
}

variable "worker_ami_id" {
  description = "AMI of the workers (for GPU types one with the NVIDIA driver, e.g. an AWS Deep Learning Base AMI), with Python >= 3.11 or a package manager that installs it."
  type        = string

  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.worker_ami_id))
    error_message = "worker_ami_id must be an AMI id (ami-...)."
  }
}

variable "worker_volume_size_gib" {
  description = "Size of a worker's root volume, GiB (encrypted); at least the AMI's snapshot."
  type        = number
  default     = 100

  validation {
    condition     = var.worker_volume_size_gib >= 8 && var.worker_volume_size_gib <= 16384 && var.worker_volume_size_gib == floor(var.worker_volume_size_gib)
    error_message = "worker_volume_size_gib must be a whole number from 8 to 16384."
  }
}

variable "model_bucket_name" {
  description = "An existing S3 bucket holding the models (workers get read access to it alone and copy the files directly under its models/ prefix into their cache at boot; the control plane's model registry keeps its artifacts below models/); null creates one."
  type        = string
  default     = null

  validation {
    condition     = var.model_bucket_name == null || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.model_bucket_name))
    error_message = "model_bucket_name must be null or an S3 bucket name."
  }
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

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.control_plane_instance_type))
    error_message = "control_plane_instance_type must be an EC2 instance type name such as t3.medium."
  }
}

variable "control_plane_ami_id" {
  description = "AMI of the control-plane host (Python >= 3.11, or a package manager that installs it); null uses worker_ami_id."
  type        = string
  default     = null

  validation {
    condition     = var.control_plane_ami_id == null || can(regex("^ami-[0-9a-f]{8,17}$", coalesce(var.control_plane_ami_id, "ami-00000000")))
    error_message = "control_plane_ami_id must be null or an AMI id (ami-...)."
  }
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

  validation {
    condition     = can(regex("^https://[^\\s'\"$`]+$", var.heteroplane_git_url))
    error_message = "heteroplane_git_url must be an https:// git URL without spaces, quotes or '$' (the hosts reach the internet on port 443 only)."
  }
}

variable "heteroplane_git_ref" {
  description = "Branch, tag or whole commit id (40 hex digits) of heteroplane_git_url to install. A commit id (or a tag that never moves) pins the code: hosts booted later (a replaced control plane, every worker) install the same, where a branch installs its head at each boot."
  type        = string
  default     = "main"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/-]*$", var.heteroplane_git_ref))
    error_message = "heteroplane_git_ref must be a branch, a tag or a whole commit id."
  }

  validation {
    # A short commit id cannot be fetched (the hosts fetch the ref by name, or a whole id).
    condition     = !can(regex("^[0-9a-fA-F]{7,39}$", var.heteroplane_git_ref))
    error_message = "heteroplane_git_ref looks like a short commit id: give the whole 40-digit id (git rev-parse REF), or a branch or tag."
  }
}

# --- what apps get by default --------------------------------------------------------------------

variable "default_budget_usd_per_hr" {
  description = "Default cost budget of an app, USD per hour (written into the app-spec defaults on the control plane)."
  type        = number
  default     = 10

  validation {
    condition     = var.default_budget_usd_per_hr >= 0.0001 && var.default_budget_usd_per_hr <= 1000000
    error_message = "default_budget_usd_per_hr must be from 0.0001 to 1000000 (an app spec's budget_usd_per_hr)."
  }
}

variable "default_slo_latency_ms" {
  description = "Default latency SLO of an app, ms."
  type        = number
  default     = 350

  validation {
    condition     = var.default_slo_latency_ms > 0 && var.default_slo_latency_ms <= 86400000
    error_message = "default_slo_latency_ms must be greater than 0 and at most 86400000 (an app spec's slo.latency_ms)."
  }
}

variable "default_slo_percentile" {
  description = "Percentile the default latency SLO applies to (99: P99)."
  type        = number
  default     = 99

  validation {
    condition     = var.default_slo_percentile > 0 && var.default_slo_percentile < 100
    error_message = "default_slo_percentile must be between 0 and 100, exclusive."
  }
}

# --- database -----------------------------------------------------------------------------------

variable "database" {
  description = "Where the control plane keeps its state: \"sqlite\" (a file on an encrypted EBS volume of its own, kept across host replacements) or \"postgresql\" (an RDS instance)."
  type        = string
  default     = "sqlite"

  validation {
    condition     = contains(["sqlite", "postgresql"], var.database)
    error_message = "database must be \"sqlite\" or \"postgresql\"."
  }
}

variable "sqlite_volume_size_gib" {
  description = "Size of the SQLite data volume, GiB (database = sqlite)."
  type        = number
  default     = 20

  validation {
    condition     = var.sqlite_volume_size_gib >= 1 && var.sqlite_volume_size_gib <= 16384 && var.sqlite_volume_size_gib == floor(var.sqlite_volume_size_gib)
    error_message = "sqlite_volume_size_gib must be a whole number from 1 to 16384."
  }
}

variable "db_instance_class" {
  description = "RDS instance class (database = postgresql)."
  type        = string
  default     = "db.t4g.micro"

  validation {
    condition     = can(regex("^db\\.[a-z0-9-]+\\.[a-z0-9]+$", var.db_instance_class))
    error_message = "db_instance_class must be an RDS instance class such as db.t4g.micro."
  }
}

variable "db_engine_version" {
  description = "PostgreSQL major (or major.minor) version of the RDS instance."
  type        = string
  default     = "16"

  validation {
    condition     = can(regex("^1[3-9](\\.[0-9]+)?$", var.db_engine_version))
    error_message = "db_engine_version must be a PostgreSQL version from 13, e.g. 16 or 16.4."
  }
}

variable "db_allocated_storage_gib" {
  description = "Storage of the RDS instance, GiB (encrypted)."
  type        = number
  default     = 20

  validation {
    condition     = var.db_allocated_storage_gib >= 20 && var.db_allocated_storage_gib <= 65536 && var.db_allocated_storage_gib == floor(var.db_allocated_storage_gib)
    error_message = "db_allocated_storage_gib must be a whole number from 20 to 65536."
  }
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

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z]{2}(-[a-z]+)+-[0-9]:[0-9]{12}:key/[a-zA-Z0-9-]+$", coalesce(var.kms_key_arn, "none")))
    error_message = "kms_key_arn must be null or a KMS key's ARN (arn:aws:kms:REGION:ACCOUNT:key/ID): not an alias's ARN, which IAM policies cannot grant the key's use by."
  }
}
