# A new VPC (when var.vpc_id is null): per zone a public subnet (the control plane, the NAT
# gateway) and a private one (the workers, the database); no subnet assigns public IPs on its
# own. An S3 gateway endpoint lets the workers read the model bucket without the NAT gateway.
# With an existing VPC only its subnets are read, to check them.

resource "aws_vpc" "this" {
  #checkov:skip=CKV2_AWS_11:flow logs are the account's logging policy (a destination, a retention, a cost per GB), not this module's; add an aws_flow_log on the vpc_id output
  count = local.create_vpc ? 1 : 0

  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = merge(local.tags, { Name = var.name })

  lifecycle {
    # At plan, not when the first subnet fails at apply.
    precondition {
      condition     = length(setsubtract(var.availability_zones, data.aws_availability_zones.available[0].names)) == 0
      error_message = "availability_zones: ${join(", ", setsubtract(var.availability_zones, data.aws_availability_zones.available[0].names))} is not an available zone of ${local.region} (it has ${join(", ", data.aws_availability_zones.available[0].names)})."
    }
  }
}

# The VPC's default security group, emptied: nothing uses it, so it allows nothing.
resource "aws_default_security_group" "this" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "${var.name}-default-deny" })
}

resource "aws_internet_gateway" "this" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = var.name })
}

resource "aws_subnet" "public" {
  count = length(local.zones)

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = cidrsubnet(var.vpc_cidr, 4, count.index)
  availability_zone       = local.zones[count.index]
  map_public_ip_on_launch = false

  tags = merge(local.tags, { Name = "${var.name}-public-${local.zones[count.index]}" })
}

resource "aws_subnet" "private" {
  count = length(local.zones)

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = cidrsubnet(var.vpc_cidr, 4, count.index + 8)
  availability_zone       = local.zones[count.index]
  map_public_ip_on_launch = false

  tags = merge(local.tags, { Name = "${var.name}-private-${local.zones[count.index]}" })
}

resource "aws_route_table" "public" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "${var.name}-public" })
}

resource "aws_route" "public_internet" {
  count = local.create_vpc ? 1 : 0

  route_table_id         = aws_route_table.public[0].id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this[0].id
}

resource "aws_route_table_association" "public" {
  count = length(local.zones)

  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public[0].id
}

resource "aws_eip" "nat" {
  count = local.create_vpc && var.create_nat_gateway ? 1 : 0

  domain = "vpc"
  tags   = merge(local.tags, { Name = "${var.name}-nat" })

  depends_on = [aws_internet_gateway.this]
}

resource "aws_nat_gateway" "this" {
  count = local.create_vpc && var.create_nat_gateway ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id
  tags          = merge(local.tags, { Name = var.name })
}

resource "aws_route_table" "private" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "${var.name}-private" })
}

resource "aws_route" "private_nat" {
  count = local.create_vpc && var.create_nat_gateway ? 1 : 0

  route_table_id         = aws_route_table.private[0].id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.this[0].id
}

resource "aws_route_table_association" "private" {
  count = length(local.zones)

  subnet_id      = aws_subnet.private[count.index].id
  route_table_id = aws_route_table.private[0].id
}

resource "aws_vpc_endpoint" "s3" {
  count = local.create_vpc ? 1 : 0

  vpc_id            = aws_vpc.this[0].id
  service_name      = "com.amazonaws.${local.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.public[0].id, aws_route_table.private[0].id]
  tags              = merge(local.tags, { Name = "${var.name}-s3" })
}

# An existing VPC: the control plane's subnet (for its zone) and the workers' (checked below).
data "aws_subnet" "control_plane" {
  count = local.create_vpc ? 0 : 1
  id    = var.control_plane_subnet_id
}

data "aws_subnet" "worker" {
  for_each = local.create_vpc ? toset([]) : toset(var.worker_subnet_ids)
  id       = each.value
}
